"""`python scripts/ppo.py` (or under `accelerate launch`):
the ppo stage: fitrl's PPO against a reward model, classifier or function.

A thin entry point: the program is `fitrl.scripts.ppo`, which `fitrl ppo` runs too."""

from fitrl.scripts.ppo import main

if __name__ == "__main__":
    main()
