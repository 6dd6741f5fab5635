#!/usr/bin/env bash
# The fitrl RLHF pipeline: each stage is one script, each reads what the stage before it wrote.
#
#   bash pipeline.sh                          # the embedded demo, on a CPU, in minutes
#   PROFILE=neox20b-24gb bash pipeline.sh     # the real gpt-neox-20b job on one 24 GB GPU
#   LAUNCH="accelerate launch --multi_gpu --num_processes 2" bash pipeline.sh   # DDP
#
# STAGES picks a subset, e.g. STAGES="ppo" bash pipeline.sh.
set -euo pipefail
cd "$(dirname "$0")"

PROFILE=${PROFILE:-demo}
LAUNCH=${LAUNCH:-accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no}
STAGES=${STAGES:-sft merge ppo eval}
[ -d "configs/$PROFILE" ] || { echo "error: no profile configs/$PROFILE; pick one of: $(ls configs | grep -v accelerate | tr '\n' ' ')" >&2; exit 2; }

run_stage() {
  local stage=$1 script=$2
  echo "== fitrl: stage '$stage' with configs/$PROFILE/$stage.yaml"
  # shellcheck disable=SC2086
  $LAUNCH "scripts/$script" --config "configs/$PROFILE/$stage.yaml"
}

for stage in $STAGES; do
  case $stage in
    sft) run_stage sft sft_lora.py ;;
    # The merge is plain file work on the CPU: no accelerate launch, one process.
    merge) echo "== fitrl: stage 'merge' with configs/$PROFILE/merge.yaml"
           python scripts/merge_adapter.py --config "configs/$PROFILE/merge.yaml" ;;
    ppo) run_stage ppo ppo_sentiment.py ;;
    eval) echo "== fitrl: stage 'eval' with configs/$PROFILE/eval.yaml"
          python scripts/evaluate_sentiment.py --config "configs/$PROFILE/eval.yaml" ;;
    *) echo "error: unknown stage '$stage'; known: sft merge ppo eval" >&2; exit 2 ;;
  esac
done
echo "== fitrl: done ($STAGES) with profile $PROFILE"
