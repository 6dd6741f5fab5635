"""fitrl: RLHF (SFT -> merge -> PPO) and GRPO for large language models on one consumer GPU.

Shared code only, one module per concern, leaves first (docs/architecture.md has the map):

- `config`: typed configs from YAML and flags, one-line errors, the run config each stage saves;
- `workload`: what one training step allocates depends on, as shapes;
- `answer_format`, `rewards`: GRPO's answer format and the pure-function rewards that check it;
- `ppo`: PPO maths as pure functions;
- `distributed`, `memory`, `outputs`, `checkpoints`: ranks, memory measurement, staged outputs and
  metrics, where checkpoints live;
- `demo` (package): the embedded demo's shipped corpus and tiny models, and the build that made them;
- `data`, `int8`, `modeling`: datasets; the CPU int8 product; models (bf16 / 8-bit / 4-bit, LoRA);
- `rollout`: sampling responses for PPO and completions for GSM8K;
- `sentiment`, `gsm8k`: the PPO and GRPO tasks;
- `stages` (package): one module per stage, the one list of stages every tool reads;
- `ppo_step`: one PPO step's experience and update;
- `memtrace`, `architectures`, `planner`: the traced step, model configs by name, the memory plan;
- `merge`: the streaming LoRA merge;
- `hf_trainer`, `ending`: glue for trl's trainers, how every training stage ends;
- `report`: what a run achieved; `quiet`: known-harmless library messages, silenced.

Each stage's story is a script in `scripts/`.
"""

from fitrl import quiet

quiet.install()

__version__ = "0.1.0"
