#!/usr/bin/env bash
# The fitrl pipeline: each stage is one script, each reads what the stage before it wrote.
#
#   bash pipeline.sh                          # the embedded demo, on a CPU, in minutes
#   PROFILE=neox20b-24gb bash pipeline.sh     # the real gpt-neox-20b RLHF job on one 24 GB GPU
#   PROFILE=llama1b-16gb bash pipeline.sh     # GRPO on GSM8K with Llama-3.2-1B-Instruct, then its evaluation
#   LAUNCH="accelerate launch --multi_gpu --num_processes 2" bash pipeline.sh   # DDP
#
# By default every stage the profile has a config for runs, in this order:
#   sft merge ppo eval     the RLHF recipe (IMDB sentiment)
#   grpo eval_gsm8k        GRPO on GSM8K and its accuracy evaluation
# STAGES picks a subset, e.g. STAGES="ppo eval" bash pipeline.sh; DRY_RUN=1 prints the commands instead.
# Each training stage is planned first (scripts/plan_memory.py); FORCE=1 runs it even if the plan does not fit.
set -euo pipefail
cd "$(dirname "$0")"

ALL_STAGES="sft merge ppo eval grpo eval_gsm8k"
PROFILE=${PROFILE:-demo}
# --quiet: a failing stage prints its own one-line error, without accelerate's traceback around it.
LAUNCH=${LAUNCH:-accelerate launch --quiet --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no}
PROFILES=$(for d in configs/*/; do d=${d%/}; d=${d#configs/}; [ "$d" = accelerate ] || echo "$d"; done | tr '\n' ' ')
case " $PROFILES " in
  *" $PROFILE "*) ;;
  *) echo "error: no profile configs/$PROFILE; pick one of: $PROFILES" >&2; exit 2 ;;
esac
if [ -z "${STAGES:-}" ]; then
  STAGES=""
  for stage in $ALL_STAGES; do [ -f "configs/$PROFILE/$stage.yaml" ] && STAGES="$STAGES $stage"; done
  STAGES=${STAGES# }
fi
[ -n "$STAGES" ] || { echo "error: profile '$PROFILE' has no stage configs (configs/$PROFILE/<stage>.yaml); pick one of: $PROFILES" >&2; exit 2; }

# Check the whole request before the first stage starts: a typo in the last stage should not cost the first.
for stage in $STAGES; do
  case " $ALL_STAGES " in *" $stage "*) ;; *) echo "error: unknown stage '$stage'; known: $ALL_STAGES" >&2; exit 2 ;; esac
  [ -f "configs/$PROFILE/$stage.yaml" ] || { echo "error: profile '$PROFILE' has no stage '$stage' (no configs/$PROFILE/$stage.yaml)" >&2; exit 2; }
done

# accelerate reports every failed child as exit 1: each stage leaves its real exit code (2 for bad
# input, 1 for a failed run) in this file, and the pipeline exits with it.
FITRL_STATUS_FILE=$(mktemp)
export FITRL_STATUS_FILE
trap 'rm -f "$FITRL_STATUS_FILE"' EXIT
run() {
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "$*"; return; fi
  : > "$FITRL_STATUS_FILE"
  "$@" || { code=$?; status=$(cat "$FITRL_STATUS_FILE"); exit "${status:-$code}"; }
}

# Before each training stage, the memory planner's answer for this machine's GPU (24 GiB assumed on
# a CPU-only machine, where it is shown but never stops the run). A plan that does not fit a GPU that
# is here stops the pipeline before anything loads, with what to change; FORCE=1 goes on regardless.
HAVE_GPU=$(python -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
plan() {
  if [ "${DRY_RUN:-0}" = 1 ]; then echo "python scripts/plan_memory.py --config $1 --brief --suggest"; return; fi
  code=0
  output=$(python scripts/plan_memory.py --config "$1" --brief --suggest 2>&1) || code=$?
  # No plan (e.g. a model whose config is not here yet): the stage checks its own settings and runs unplanned.
  if [ "$code" = 2 ]; then
    echo "note: no memory plan for $1 (${output##*error: }); the stage runs unplanned" >&2
  else
    echo "$output" >&2
  fi
  if [ "$code" = 1 ] && [ "$HAVE_GPU" = 1 ] && [ "${FORCE:-0}" != 1 ]; then
    echo "error: the memory plan for $1 does not fit this GPU; apply a suggestion above, or FORCE=1 to run anyway" >&2
    exit 1
  fi
}

for stage in $STAGES; do
  config="configs/$PROFILE/$stage.yaml"
  echo "== fitrl: stage '$stage' with $config" >&2
  case $stage in sft | ppo | grpo) plan "$config" ;; esac
  # shellcheck disable=SC2086  # LAUNCH is a command line: split it into words
  case $stage in
    # Training stages go through accelerate (one GPU, DDP, DeepSpeed, FSDP: whatever LAUNCH says).
    sft) run $LAUNCH scripts/sft_lora.py --config "$config" ;;
    ppo) run $LAUNCH scripts/ppo_sentiment.py --config "$config" ;;
    grpo) run $LAUNCH scripts/grpo_gsm8k.py --config "$config" ;;
    # The merge is file work on the CPU and the evaluations are one-process generation: plain python.
    merge) run python scripts/merge_adapter.py --config "$config" ;;
    eval) run python scripts/evaluate_sentiment.py --config "$config" ;;
    eval_gsm8k) run python scripts/evaluate_gsm8k.py --config "$config" ;;
  esac
done
echo "== fitrl: done ($STAGES) with profile $PROFILE"
