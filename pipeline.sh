#!/usr/bin/env bash
# The fitrl pipeline: every stage of a profile, in one run directory, skipping what is done.
#
#   bash pipeline.sh                          # the embedded demo, on a CPU, in minutes
#   bash pipeline.sh --profile neox20b-24gb   # the real gpt-neox-20b RLHF job on one 24 GB GPU
#   bash pipeline.sh --profile llama1b-16gb   # GRPO on GSM8K with Llama-3.2-1B-Instruct, then its evaluation
#   bash pipeline.sh --profile qwen0.5b-16gb  # SFT, RM, PPO, DPO and GRPO for Qwen2.5-0.5B-Instruct in 16 GB
#   bash pipeline.sh --help                   # stages, profiles, launchers, options, examples
#
# The logic is in fitrl/scripts/pipeline.py; the environment variables PROFILE, STAGES, RUN_DIR, LAUNCH,
# FORCE=1 and DRY_RUN=1 do what the options do.
set -euo pipefail
cd "$(dirname "$0")"
# The project's virtual environment (`make setup`) when there is one, else the python on PATH.
PYTHON=python
if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
exec "$PYTHON" -m fitrl.scripts.pipeline "$@"
