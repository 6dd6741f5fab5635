"""`python scripts/pipeline.py`:
the pipeline: every stage of a profile in one run directory (bash pipeline.sh).

A thin entry point: the program is `fitrl.scripts.pipeline`, which `fitrl pipeline` runs too."""

from fitrl.scripts.pipeline import main

if __name__ == "__main__":
    main()
