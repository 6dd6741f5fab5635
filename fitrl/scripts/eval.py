"""Evaluate a PPO or DPO policy against its reference on held-out prompts: reward, positive share, KL,
win rate, and a judge.

The policy is the merged model with the PPO (or DPO) adapter; the reference is the same model with the
adapter disabled. Both answer the same held-out queries with the same response lengths. Besides the reward
(and the share the reward classifier calls positive), a second judge the policy never trained against
scores both (`judge_model`: the proxy-vs-gold check of reward over-optimisation), and the share of
response words that are words of the training corpus tells text of the corpus's kind from word salad.

    python scripts/eval.py --config configs/demo/eval.yaml
    python scripts/eval.py --config configs/neox20b-24gb/eval.yaml --n_prompts 512
    python scripts/eval.py --config configs/demo/eval_dpo.yaml   # the DPO policy, same prompts

Writes to `output_dir`: `eval.json` (summary and per-sample rows), `eval.md` (a short table and
side-by-side samples) and `reward_hist.png`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fitrl.artifacts import JudgeFigures, ResponseScores, SentimentEval, carved_note, written_by
from fitrl.checkpoints import check_adapter_base, check_adapter_files, policy_adapter
from fitrl.config import save_run_config
from fitrl.data import carved_from, split_name
from fitrl.modeling import load_causal_lm, load_tokenizer, resolve_model_path
from fitrl.outputs import check_output_dir, markdown_cell, plot_histograms, staged_output_dir
from fitrl.process import entrypoint
from fitrl.reward.factory import check_reward, load_reward
from fitrl.rollout import decode, rendered_queries, response_logprobs, sample_responses
from fitrl.stages.eval_sentiment import STAGE
from fitrl.tasks.sentiment import (
    SentimentJudge,
    build_queries,
    check_judge,
    corpus_vocabulary,
    corpus_word_share,
    prompt_texts,
)


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


@entrypoint
def main(argv: list[str] | None = None) -> None:
    model_args, prompt_args, reward_args, args, demo_args = STAGE.parse(argv)
    adapter_dir, model_path, reward_base = preflight(model_args, prompt_args, reward_args, args, demo_args)
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code)
    built = build_queries(tokenizer, prompt_args, demo_args.demo_assets, args.seed, reward_args.reward_columns)
    queries = built.ids[: args.n_prompts]
    columns = {k: v[: args.n_prompts] for k, v in built.columns.items()}  # reward_columns, as PPO read them
    stop_at_eos = prompt_args.stops_at_eos(built.chat)  # as PPO resolved it (its setting stays as given)

    from peft import PeftModel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_causal_lm(model_args, path=model_path, for_training=False, pad_token_id=tokenizer.pad_token_id)
    if model_args.quantization == "none":
        model.to(device)
    policy = PeftModel.from_pretrained(model, policy_adapter(adapter_dir)).eval()
    reward = load_reward(reward_args, demo_args.demo_assets, device, reward_base, policy, tokenizer)
    judge = None
    if args.judge_model:
        judge = SentimentJudge(args.judge_model, args.judge_positive_label, demo_args.demo_assets, device)
    vocabulary = corpus_vocabulary(prompt_texts(prompt_args, "train", demo_args.demo_assets))

    with staged_output_dir(args.output_dir, args.overwrite_output_dir, stage=STAGE.name) as out:
        rows = answer_and_score(
            policy, tokenizer, queries, columns, prompt_args, stop_at_eos, args, reward, judge, device
        )
        source, split = prompt_args.dataset, prompt_args.dataset_split
        where = (split_name(source, split), carved_from(source, split))
        report = summarize(rows, vocabulary, judge, adapter_dir, model_args.model_name_or_path, *where)
        report.write(out)
        table = report_table(report, args.n_samples_shown)
        (out / "eval.md").write_text(table)
        plot_histograms(
            {"reference": [r["reference_reward"] for r in rows], "policy": [r["policy_reward"] for r in rows]},
            out / "reward_hist.png",
            "reward",
            "responses",
        )
        save_run_config(out, model_args, prompt_args, reward_args, args, demo_args)
    print(table)


def preflight(model_args, prompt_args, reward_args, args, demo_args) -> tuple[Path, str, str | None]:
    """Every input checked before a weight loads: the output dir, the adapter, its base, the reward label.
    Returns the adapter, the resolved model, and the base a reward adapter is loaded on by itself."""
    reward = reward_args.reward_adapter or reward_args.reward_model
    inputs = [args.adapter_dir, model_args.model_name_or_path, reward, prompt_args.dataset]
    check_output_dir(args.output_dir, args.overwrite_output_dir, inputs, demo_args.demo_assets)
    adapter_dir = Path(args.adapter_dir).expanduser()
    check_adapter_files(policy_adapter(adapter_dir), "policy")  # a run's output, or a PPO checkpoint
    model_path = resolve_model_path(model_args.model_name_or_path, demo_args.demo_assets)
    made_by = written_by(adapter_dir)  # the same evaluation judges PPO's and DPO's policies
    producer = made_by if made_by in STAGE.judges else STAGE.reads[1]
    check_adapter_base(adapter_dir, model_args.model_name_or_path, model_path, STAGE.name, args.force, producer)
    reward_base = check_reward(
        reward_args,
        model_args.model_name_or_path,
        model_path,
        demo_args.demo_assets,
        STAGE.name,
        STAGE.producer_of("reward_adapter"),
    )
    if args.judge_model:
        check_judge(args.judge_model, args.judge_positive_label, demo_args.demo_assets)
    return adapter_dir, model_path, reward_base


def answer_and_score(
    policy, tokenizer, queries, columns, prompt_args, stop_at_eos, args, reward, judge, device
) -> list[dict]:
    """Policy and reference answer every query at the same drawn length; the reward and judge score both."""
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(
        prompt_args.response_min_tokens, prompt_args.response_max_tokens + 1, (len(queries),), generator=gen
    ).tolist()
    ends = prompt_args.sentence_ends(tokenizer)  # as PPO cut them
    rows = []
    for c in range(0, len(queries), args.batch_size):
        qs, ls = queries[c : c + args.batch_size], lengths[c : c + args.batch_size]
        torch.manual_seed(args.seed + c)
        rollout = sample_responses(policy, tokenizer, qs, ls, stop_at_eos, device, sentence_ends=ends)
        with torch.no_grad():  # KL(policy || reference) on the policy's own samples, summed over tokens
            logp = response_logprobs(policy, rollout)
            with policy.disable_adapter():
                ref_logp = response_logprobs(policy, rollout)
                torch.manual_seed(args.seed + c)
                ref_rollout = sample_responses(policy, tokenizer, qs, ls, stop_at_eos, device, sentence_ends=ends)
        kl = ((logp - ref_logp) * rollout.response_mask).sum(1)
        q_texts, p_texts = decode(tokenizer, rollout)
        _, r_texts = decode(tokenizer, ref_rollout)
        texts = {
            "policy": [q + r for q, r in zip(q_texts, p_texts)],
            "reference": [q + r for q, r in zip(q_texts, r_texts)],
        }
        batch = {k: v[c : c + args.batch_size] for k, v in columns.items()}
        read = rendered_queries(tokenizer, rollout) if reward.rendered else q_texts  # as PPO's reward read them
        scored = {
            who: reward.score(read, rs, {**batch, "completion_ids": r.response_ids()})
            for who, rs, r in [("policy", p_texts, rollout), ("reference", r_texts, ref_rollout)]
        }
        verdicts = {who: judge(t) if judge else None for who, t in texts.items()}
        for i, q in enumerate(q_texts):
            row = {"query": q, "policy_response": p_texts[i], "reference_response": r_texts[i], "kl": kl[i].item()}
            for who in texts:
                row[f"{who}_reward"] = scored[who][0][i].item()
                row[f"{who}_positive"] = bool(scored[who][1][i])
                if judge:
                    row[f"{who}_judge"] = verdicts[who][i].item()
            rows.append(row)
    return rows


def summarize(
    rows: list[dict], vocabulary: set[str], judge, adapter_dir: Path, model: str, split: str, carved: str | None
) -> SentimentEval:
    """The headline figures of both sides, then every sample."""
    n = len(rows)

    def side(who: str) -> ResponseScores:
        return ResponseScores(
            **summary(torch.tensor([r[f"{who}_reward"] for r in rows])),
            positive_share=sum(r[f"{who}_positive"] for r in rows) / n,
            corpus_word_share=corpus_word_share(
                [r["query"] for r in rows], [r[f"{who}_response"] for r in rows], vocabulary
            ),
        )

    # The share of prompts whose policy response the reward model scores above the reference's (ties: half).
    wins = [
        1.0 if r["policy_reward"] > r["reference_reward"] else 0.5 * (r["policy_reward"] == r["reference_reward"])
        for r in rows
    ]
    verdicts = None
    if judge:  # the judge's positive share of each side, and its mean verdict in [-1, 1]
        verdicts = JudgeFigures(
            model=judge.name,
            policy=sum(r["policy_judge"] > 0 for r in rows) / n,
            policy_mean=sum(r["policy_judge"] for r in rows) / n,
            reference=sum(r["reference_judge"] > 0 for r in rows) / n,
            reference_mean=sum(r["reference_judge"] for r in rows) / n,
        )
    return SentimentEval(
        n_prompts=n,
        adapter_dir=str(adapter_dir),
        model=model,
        split=split,
        carved_from=carved,
        policy=side("policy"),
        reference=side("reference"),
        kl_mean=sum(r["kl"] for r in rows) / n,
        win_rate=sum(wins) / n,
        judge=verdicts,
        samples=rows,
    )


def report_table(report: SentimentEval, n_shown: int) -> str:
    judge = report.judge
    head = "| | mean reward | std | p10 | median | p90 | called positive | prompt-corpus words |"
    if judge:
        head += f" judge ({judge.model}): positive |"

    def line(name: str, s: ResponseScores, who: str) -> str:
        cells = [s.mean, s.std, s.p10, s.median, s.p90]
        text = f"| {name} | " + " | ".join(f"{v:.3f}" for v in cells)
        text += f" | {s.positive_share:.0%} | {s.corpus_word_share:.1%} |"
        return text + (f" {getattr(judge, who):.0%} |" if judge else "")

    lines = [
        f"# Policy evaluation: adapter on against adapter off ({report.n_prompts} held-out prompts"
        f"{carved_note(report.split, report.carved_from)})",
        "",
        head,
        "|---" * (head.count("|") - 1) + "|",
        line("policy (adapter on)", report.policy, "policy"),
        line("reference (adapter off)", report.reference, "reference"),
        "",
        f"Mean KL(policy || reference) per response: {report.kl_mean:.3f} nats; the reward model prefers the "
        f"policy's response on {report.win_rate:.0%} of the prompts",
        "",
        "| query | policy | reward | reference | reward |",
        "|---|---|---|---|---|",
    ]
    for s in report.samples[:n_shown]:
        cells = [markdown_cell(s[k]) for k in ("query", "policy_response", "reference_response")]
        lines.append(
            f"| {cells[0]} | {cells[1]} | {s['policy_reward']:.2f} | {cells[2]} | {s['reference_reward']:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
