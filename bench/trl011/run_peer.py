"""The peer side of `bench/ppo_vs_trl011.py`: TRL 0.11.4's PPOTrainer on the benchmark's model and prompts.

Runs in its own virtual environment (`make bench-peer-env`), never in fitrl's: TRL 0.11.4 needs
transformers 4.x. Prints one JSON object: per-step phase times, the peak of live tensor bytes of
step 2 and the process's peak RSS. Not meant to be run by hand; the benchmark passes the settings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def fitrl_memory():
    # fitrl's live-tensor tracker, loaded by file: fitrl itself needs transformers 5.
    spec = importlib.util.spec_from_file_location("fitrl_memory", ROOT / "fitrl" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def allow_bnb_on_cpu() -> None:
    # transformers 4.47 believes bitsandbytes needs IPEX on a CPU; bitsandbytes 0.50 does not.
    import transformers.integrations.bitsandbytes as tb

    tb._validate_bnb_multi_backend_availability = lambda raise_exception: True


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ["model", "classifier", "reviews"]:
        p.add_argument(f"--{name}", required=True)
    ints = ["steps", "batch_size", "mini_batch_size", "ppo_epochs", "query_tokens", "response_tokens", "seed"]
    for name in [*ints, "generation_batch_size", "lora_r", "lora_alpha", "threads"]:
        p.add_argument(f"--{name}", type=int, required=True)
    for name in ["lora_dropout", "learning_rate"]:
        p.add_argument(f"--{name}", type=float, required=True)
    p.add_argument("--quantization", choices=["none", "8bit"], required=True)
    return p.parse_args()


def build_trainer(args: argparse.Namespace, tokenizer):
    """The blog's setup: a value-head model with a fresh LoRA adapter, the reference is the adapter off."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

    config = PPOConfig(
        batch_size=args.batch_size,
        mini_batch_size=args.mini_batch_size,
        ppo_epochs=args.ppo_epochs,
        learning_rate=args.learning_rate,
        seed=args.seed,
        log_with=None,
    )
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=["query_key_value"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    base, kwargs = args.model, {}
    if args.quantization == "8bit":
        allow_bnb_on_cpu()
        base = AutoModelForCausalLM.from_pretrained(
            args.model, quantization_config=BitsAndBytesConfig(load_in_8bit=True)
        )
        # TRL 0.11 refuses a device map that names the CPU (it means offloading on a GPU machine);
        # here the CPU is the device.
        del base.hf_device_map
        # The blog's preparation of an 8-bit base, less activation checkpointing (fitrl does not
        # checkpoint here either).
        kwargs = {"use_gradient_checkpointing": False}
    model = AutoModelForCausalLMWithValueHead.from_pretrained(base, peft_config=lora, **kwargs)
    return PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)


def classifier_scorer(path: str):
    """texts -> the classifier's positive logit per text (the reward fitrl's demo uses)."""
    from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(path) / "tokenizer.json"))
    tokenizer.pad_token = "[PAD]"
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    positive = model.config.label2id["POSITIVE"]

    @torch.no_grad()
    def score(texts: list[str]) -> torch.Tensor:
        enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=128)
        enc.pop("token_type_ids", None)
        return model(**enc).logits[:, positive]

    return score


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from transformers import PreTrainedTokenizerFast

    memory = fitrl_memory()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(args.model) / "tokenizer.json"))
    tokenizer.eos_token = tokenizer.pad_token = "<|endoftext|>"
    reviews = [json.loads(line)["text"] for line in Path(args.reviews).read_text().splitlines()]
    queries = [torch.tensor(tokenizer(t).input_ids[: args.query_tokens]) for t in reviews]
    queries = [q for q in queries if len(q) == args.query_tokens]
    trainer = build_trainer(args, tokenizer)
    score = classifier_scorer(args.classifier)
    gen = {
        "top_k": 0,
        "top_p": 1.0,
        "do_sample": True,
        "max_new_tokens": args.response_tokens,
        "min_new_tokens": args.response_tokens,
        "pad_token_id": tokenizer.eos_token_id,
    }
    rows = []
    peak_tensor_bytes = None
    for step in range(args.steps):
        batch = [queries[(step * args.batch_size + i) % len(queries)] for i in range(args.batch_size)]
        tracker = None
        if step == 1:  # the second step: the optimizer states exist by then
            model = trainer.model
            held = [*model.parameters(), *model.buffers(), *memory.optimizer_state_tensors(trainer.optimizer)]
            held_bytes = memory.tensor_bytes(held)
            tracker = memory.LiveTensorBytes()
            tracker.__enter__()
        t0 = time.perf_counter()
        responses = trainer.generate(batch, batch_size=args.generation_batch_size, return_prompt=False, **gen)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        scores = score(tokenizer.batch_decode([torch.cat([q, r]) for q, r in zip(batch, responses)]))
        t_score = time.perf_counter() - t0
        stats = trainer.step(batch, responses, list(scores))
        if tracker is not None:
            tracker.__exit__(None, None, None)
            peak_tensor_bytes = held_bytes + tracker.peak
        nograd = (
            stats["time/ppo/forward_pass"] + stats["time/ppo/compute_rewards"] + stats["time/ppo/compute_advantages"]
        )
        rows.append(
            {
                "generate": t_gen,
                "score": t_score,
                "forward": nograd,
                "optimise": stats["time/ppo/optimize_step"],
                "step": t_gen + stats["time/ppo/total"],
                "reward": float(scores.mean()),
            }
        )
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": rows, "peak_tensor_mb": peak_tensor_bytes / 2**20, "peak_rss_mb": peak_rss_mb}))


if __name__ == "__main__":
    main()
