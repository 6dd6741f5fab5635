"""`python scripts/grpo.py` (or under `accelerate launch`):
the grpo stage: GRPO on GSM8K-style problems.

A thin entry point: the program is `fitrl.scripts.grpo`, which `fitrl grpo` runs too."""

from fitrl.scripts.grpo import main

if __name__ == "__main__":
    main()
