"""fitrl: RLHF on the GPU one person has: SFT, a reward model, PPO, DPO and GRPO with LoRA on 8-bit or
4-bit models, a memory planner, guards and a report.

Each stage is a record in `fitrl.stages` and a program in `fitrl.scripts` (`fitrl <stage>` runs it);
the rest of the package is what more than one program needs, one module per concern. The one map of
the package, a line per module, is docs/architecture.md.
"""

from fitrl import quiet

quiet.install()

__version__ = "0.1.0"
