"""The reward PPO trains against and its evaluation scores with: one protocol, each kind in its module.

- `base`: the `Reward` protocol (texts in, scores out, the tensors it holds) and `TextReward`;
- `settings`: `RewardArguments`, the settings that name a reward;
- `classifier`: a sequence classifier (hub id, local dir, `demo://classifier`);
- `adapter`: an rm stage's adapter, on the policy's own backbone or its own copy of its base;
- `functions`: a Python function, by registry name or `module:function` (GRPO's reward functions too);
- `factory`: `check_reward` and `load_reward`, which decide the kind once;
- `probes`: the reward pre-flight, degenerate completions scored beside the reference's own.
"""
