"""`python scripts/eval_gsm8k.py` (or under `accelerate launch`):
the eval_gsm8k stage: GSM8K accuracy with and without the adapter.

A thin entry point: the program is `fitrl.scripts.eval_gsm8k`, which `fitrl eval_gsm8k` runs too."""

from fitrl.scripts.eval_gsm8k import main

if __name__ == "__main__":
    main()
