"""`python scripts/sft.py` (or under `accelerate launch`):
the sft stage: LoRA fine-tuning of a frozen (8-bit) base.

A thin entry point: the program is `fitrl.scripts.sft`, which `fitrl sft` runs too."""

from fitrl.scripts.sft import main

if __name__ == "__main__":
    main()
