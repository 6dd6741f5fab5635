"""`python scripts/dpo.py` (or under `accelerate launch`):
the dpo stage: DPO on preference pairs.

A thin entry point: the program is `fitrl.scripts.dpo`, which `fitrl dpo` runs too."""

from fitrl.scripts.dpo import main

if __name__ == "__main__":
    main()
