"""The names of PPO's logged metrics (`metrics.jsonl`, trackers), defined once.

The trainer writes them; the stage's monitors, figures and progress bar, the reward-hacking guard and
the tests read them through these names, so a renamed metric cannot silently disarm a guard.
"""

from __future__ import annotations

STEP = "step"
REWARD_MEAN = "env/reward_mean"  # the raw score, before scaling and clipping
REWARD_STD = "env/reward_std"
KL = "objective/kl"  # nats per response, summed over its tokens, averaged over the batch
KL_COEF = "objective/kl_coef"
ENTROPY = "objective/entropy"
NON_SCORE_REWARD = "objective/non_score_reward"
POLICY_LOSS = "ppo/policy_loss"
VALUE_LOSS = "ppo/value_loss"
CLIPFRAC = "ppo/clipfrac"
VALUE_CLIPFRAC = "ppo/value_clipfrac"
APPROX_KL = "ppo/approx_kl"
RATIO_MEAN = "ppo/ratio_mean"
SKIPPED_BATCHES = "ppo/skipped_batches"
EXPLAINED_VARIANCE = "ppo/explained_variance"
RESPONSE_LENGTH = "env/response_length"
REPETITION = "env/repetition"
JUDGE_MEAN = "heldout/judge_mean"  # the reward-hacking guard's judge, on the steps it reads
TIME_GENERATE = "time/generate"
TIME_SCORE = "time/score"
TIME_FORWARD = "time/forward"
TIME_OPTIMISE = "time/optimise"
TOKENS_PER_SECOND = "tokens_per_second"
GPU_PEAK_MB = "memory/gpu_peak_mb"
