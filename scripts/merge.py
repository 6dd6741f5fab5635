"""`python scripts/merge.py` (or under `accelerate launch`):
the merge stage: the adapter folded into its base, shard by shard.

A thin entry point: the program is `fitrl.scripts.merge`, which `fitrl merge` runs too."""

from fitrl.scripts.merge import main

if __name__ == "__main__":
    main()
