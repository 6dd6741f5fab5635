"""`python scripts/eval.py` (or under `accelerate launch`):
the eval and eval_dpo stages: a policy against its reference on held-out prompts.

A thin entry point: the program is `fitrl.scripts.eval`, which `fitrl eval` runs too."""

from fitrl.scripts.eval import main

if __name__ == "__main__":
    main()
