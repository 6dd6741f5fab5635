"""fitrl: RLHF (SFT -> merge -> PPO) and GRPO for large language models on one consumer GPU.

Shared code only, one module per concern: `config` (typed configs, one-line errors), `modeling`
(loading, quantization, LoRA), `data` (datasets), `demo` (the embedded demo assets), `outputs`
(staged output directories, metrics, plots). Each stage is a script in `scripts/`.
"""

__version__ = "0.1.0"
