"""`python scripts/rm.py` (or under `accelerate launch`):
the rm stage: a reward model from preference pairs.

A thin entry point: the program is `fitrl.scripts.rm`, which `fitrl rm` runs too."""

from fitrl.scripts.rm import main

if __name__ == "__main__":
    main()
