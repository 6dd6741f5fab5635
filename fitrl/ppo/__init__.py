"""fitrl's PPO engine, apart from any task: it knows prompts as token ids and a reward as a `Reward`.

- `core`: the maths as pure functions (GAE, whitening, KL estimators, clipped losses, controllers).
- `step`: one step after sampling (`PolicyAndValue`, `Experience`, `make_experience`, `ppo_update`),
  which the memory planner traces too.
- `trainer`: `PPOTrainer`, whose state (`PPOState`) is exactly what a checkpoint holds, with
  `step`, `save` and `load` as methods.
- `metrics`: the names of the logged metrics, imported by the guards, figures and progress bar.

Nothing is imported here: `fitrl.rollout` reads `core`, and `trainer` reads `fitrl.rollout`.
"""
