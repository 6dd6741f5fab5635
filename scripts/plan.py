"""`python scripts/plan.py`:
the memory plan of a stage's config on a card (fitrl plan).

A thin entry point: the program is `fitrl.scripts.plan`, which `fitrl plan` runs too."""

from fitrl.scripts.plan import main

if __name__ == "__main__":
    main()
