"""The eval_dpo stage: the DPO policy against its reference on held-out prompts, exactly as `eval` judges
PPO's (the same script, prompts, reward, judge and KL), so the report sets the two side by side.

Program: `fitrl.scripts.eval`. The DPO run has no prompt or reward settings of its own: its
config names them. Writes `eval.json`, `eval.md`, `reward_hist.png`.
"""

from __future__ import annotations

import dataclasses

from fitrl.stages.eval_sentiment import STAGE as EVAL

STAGE = dataclasses.replace(EVAL, name="eval_dpo", output_dir="eval_dpo", reads=("adapter_dir", "dpo"))
