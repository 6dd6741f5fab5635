"""Evaluate a PPO policy against its reference on held-out prompts: reward, its distribution, KL.

The policy is the merged model with the PPO adapter; the reference is the same model with the adapter
disabled. Both answer the same held-out queries with the same response lengths.

    python scripts/evaluate_sentiment.py --config configs/demo/eval.yaml
    python scripts/evaluate_sentiment.py --config configs/neox20b-24gb/eval.yaml --n_prompts 512

Writes to `output_dir`: `eval.json` (summary and per-sample rows), `eval.md` (a short table and
side-by-side samples) and `reward_hist.png`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fitrl.config import UsageError, check, entrypoint, help_field, load_run_config, parse_config, save_run_config
from fitrl.demo import DemoArguments
from fitrl.modeling import ModelArguments, check_adapter_base, load_causal_lm, load_tokenizer, resolve_model_path
from fitrl.outputs import check_output_dir, markdown_cell, staged_output_dir
from fitrl.rollout import decode, response_logprobs, sample_responses
from fitrl.sentiment import PromptArguments, RewardArguments, SentimentReward, build_queries, check_reward_label


@dataclass
class EvalArguments:
    """What to evaluate and where the report goes."""

    adapter_dir: str = help_field("outputs/ppo", "The PPO stage's output directory (the policy adapter).")
    output_dir: str = help_field("outputs/eval", "Where eval.json, eval.md and reward_hist.png go.")
    overwrite_output_dir: bool = help_field(False, "Replace a non-empty output_dir.")
    n_prompts: int = help_field(128, "Held-out prompts to answer.")
    batch_size: int = help_field(32, "Prompts per generation batch.")
    n_samples_shown: int = help_field(6, "Side-by-side samples in eval.md.")
    seed: int = help_field(1234, "Seed of the query lengths, response lengths and sampling.")
    force: bool = help_field(False, "Evaluate even if the adapter says it was trained on another model or stage.")

    def validate(self) -> None:
        check(self.n_prompts >= 1, "n_prompts", ">= 1")
        check(self.batch_size >= 1, "batch_size", ">= 1")
        check(self.n_samples_shown >= 0, "n_samples_shown", ">= 0")


CONFIG_TYPES = [ModelArguments, PromptArguments, RewardArguments, EvalArguments, DemoArguments]


def summary(scores: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(scores, torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9]))
    return {
        "mean": scores.mean().item(),
        "std": scores.std().item(),
        "p10": q[0].item(),
        "p25": q[1].item(),
        "median": q[2].item(),
        "p75": q[3].item(),
        "p90": q[4].item(),
    }


def ppo_settings(argv: list[str] | None) -> dict:
    """The model, prompt and reward settings the PPO run wrote to its `run_config.yaml`.

    The evaluation answers prompts the way the policy was trained to, unless the config or a flag
    says otherwise; only the split (held-out prompts) and the number of prompts are its own.
    """
    (*_, eval_args, _demo) = parse_config(CONFIG_TYPES, argv)
    trained = load_run_config(Path(eval_args.adapter_dir).expanduser())
    inherited = {f.name for t in (ModelArguments, PromptArguments, RewardArguments) for f in dataclasses.fields(t)}
    inherited -= {"dataset_split", "max_prompts"}
    return {k: v for k, v in trained.items() if k in inherited}


def resolve_config(argv: list[str] | None) -> tuple:
    """The evaluation's settings: its config and flags over what the PPO run was trained with."""
    return parse_config(CONFIG_TYPES, argv, ppo_settings(argv))


@entrypoint
def main(argv: list[str] | None = None) -> None:
    model_args, prompt_args, reward_args, args, demo_args = resolve_config(argv)
    inputs = [args.adapter_dir, model_args.model_name_or_path, reward_args.reward_model, prompt_args.dataset]
    check_output_dir(args.output_dir, args.overwrite_output_dir, inputs)
    adapter_dir = Path(args.adapter_dir).expanduser()
    if not (adapter_dir / "adapter_config.json").is_file():
        raise UsageError(f"no adapter_config.json in {adapter_dir}; point adapter_dir to the PPO output")
    model_path = resolve_model_path(model_args.model_name_or_path, demo_args.demo_cache_dir)
    check_adapter_base(adapter_dir, model_args.model_name_or_path, model_path, "eval", args.force, producer="ppo")
    check_reward_label(
        resolve_model_path(reward_args.reward_model, demo_args.demo_cache_dir, "reward model"),
        reward_args.positive_label,
    )
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)
    queries = build_queries(tokenizer, prompt_args, demo_args.demo_cache_dir, args.seed)[: args.n_prompts]

    from peft import PeftModel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(model_args, path=model_path, for_training=False, pad_token_id=tokenizer.pad_token_id)
    if model_args.quantization == "none":
        model.to(device)
    policy = PeftModel.from_pretrained(model, adapter_dir).eval()
    reward = SentimentReward(reward_args, demo_args.demo_cache_dir, device)
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(
        prompt_args.response_min_tokens, prompt_args.response_max_tokens + 1, (len(queries),), generator=gen
    ).tolist()

    rows = []
    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage="eval") as out:
        for c in range(0, len(queries), args.batch_size):
            qs, ls = queries[c : c + args.batch_size], lengths[c : c + args.batch_size]
            torch.manual_seed(args.seed + c)
            rollout = sample_responses(policy, tokenizer, qs, ls, prompt_args.stop_at_eos, device)
            with torch.no_grad():  # KL(policy || reference) on the policy's own samples, summed over tokens
                logp = response_logprobs(policy, rollout)
                with policy.disable_adapter():
                    ref_logp = response_logprobs(policy, rollout)
                    torch.manual_seed(args.seed + c)
                    ref_rollout = sample_responses(policy, tokenizer, qs, ls, prompt_args.stop_at_eos, device)
            kl = ((logp - ref_logp) * rollout.response_mask).sum(1)
            q_texts, p_texts = decode(tokenizer, rollout)
            _, r_texts = decode(tokenizer, ref_rollout)
            p_scores = reward([q + r for q, r in zip(q_texts, p_texts)])
            r_scores = reward([q + r for q, r in zip(q_texts, r_texts)])
            for i, q in enumerate(q_texts):
                rows.append(
                    {
                        "query": q,
                        "policy_response": p_texts[i],
                        "policy_reward": p_scores[i].item(),
                        "reference_response": r_texts[i],
                        "reference_reward": r_scores[i].item(),
                        "kl": kl[i].item(),
                    }
                )

        p_all = torch.tensor([r["policy_reward"] for r in rows])
        r_all = torch.tensor([r["reference_reward"] for r in rows])
        report = {
            "n_prompts": len(rows),
            "adapter_dir": str(adapter_dir),
            "model": model_args.model_name_or_path,
            "policy": summary(p_all),
            "reference": summary(r_all),
            "kl_mean": sum(r["kl"] for r in rows) / len(rows),
            "samples": rows,
        }
        (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        table = report_table(report, args.n_samples_shown)
        (out / "eval.md").write_text(table)
        plot_histogram(p_all, r_all, out / "reward_hist.png")
        save_run_config(out, model_args, prompt_args, reward_args, args, demo_args)
    print(table)


def report_table(report: dict, n_shown: int) -> str:
    p, r = report["policy"], report["reference"]
    lines = [
        f"# Sentiment evaluation ({report['n_prompts']} held-out prompts)",
        "",
        "| | mean reward | std | p10 | median | p90 |",
        "|---|---|---|---|---|---|",
        f"| policy (PPO adapter) | {p['mean']:.3f} | {p['std']:.3f} | {p['p10']:.3f} | {p['median']:.3f} | "
        f"{p['p90']:.3f} |",
        f"| reference (adapter off) | {r['mean']:.3f} | {r['std']:.3f} | {r['p10']:.3f} | {r['median']:.3f} | "
        f"{r['p90']:.3f} |",
        "",
        f"Mean KL(policy || reference) per response: {report['kl_mean']:.3f} nats",
        "",
        "| query | policy | reward | reference | reward |",
        "|---|---|---|---|---|",
    ]
    for s in report["samples"][:n_shown]:
        cells = [markdown_cell(s[k]) for k in ("query", "policy_response", "reference_response")]
        lines.append(
            f"| {cells[0]} | {cells[1]} | {s['policy_reward']:.2f} | {cells[2]} | {s['reference_reward']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot_histogram(policy: torch.Tensor, reference: torch.Tensor, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    bins = torch.linspace(min(policy.min(), reference.min()).item(), max(policy.max(), reference.max()).item(), 30)
    ax.hist(reference.numpy(), bins=bins.numpy(), alpha=0.6, label=f"reference (mean {reference.mean():.2f})")
    ax.hist(policy.numpy(), bins=bins.numpy(), alpha=0.6, label=f"policy (mean {policy.mean():.2f})")
    ax.set_xlabel("reward")
    ax.set_ylabel("responses")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
