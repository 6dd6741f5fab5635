"""GRPO on GSM8K: a LoRA adapter learns to reason in a fixed format and get the number right.

The recipe that took Llama-3.2-1B-Instruct from about 19% to about 40% GSM8K accuracy in one epoch,
set up to fit a 16 GB card. For each question the policy samples `num_generations` completions; the
rewards score them (by default GSM8K's three, `fitrl.tasks.grading`: strict format 0.5, soft format 0.5,
accuracy 2.0; `--reward_funcs` takes registry names or your own `module:function`, `fitrl.reward.functions`);
each completion's advantage is its reward relative to its group's. trl's `GRPOTrainer` runs the loop;
fitrl loads the model (bf16, 8-bit or 4-bit base, frozen) and builds the prompts and rewards. With
`beta > 0` the reference log-probs come from the same model with the adapter disabled.

    # the embedded demo, on a CPU in a few minutes (a tiny model that has seen the answer format)
    accelerate launch scripts/grpo.py --config configs/demo/grpo.yaml
    # Llama-3.2-1B-Instruct on one 16 GB card
    accelerate launch scripts/grpo.py --config configs/llama1b-16gb/grpo.yaml
    # your own reward function beside GSM8K's accuracy, weighted
    accelerate launch scripts/grpo.py --config configs/demo/grpo.yaml \
        --reward_funcs accuracy my_rewards.py:brevity --reward_weights 1.0 0.2
    # continue a stopped run from its last checkpoint
    accelerate launch scripts/grpo.py --config configs/llama1b-16gb/grpo.yaml --resume_from_checkpoint latest

vLLM generation (`--use_vllm true`, colocated on the training GPU) is optional and off by default:
it needs `pip install vllm` and a CUDA GPU, and nothing else in fitrl depends on it.

Writes to `output_dir`: the adapter, the tokenizer, `run_config.yaml`, `run_info.json`,
`metrics.jsonl`, `grpo_curves.png` and `samples.md` (greedy completions before and after training).
Trainer checkpoints go to `<output_dir>.checkpoints/`, outside the staged output, so a stopped run keeps them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fitrl.checkpoints import checkpoint_root, resume_checkpoint
from fitrl.config import UsageError, config_dict, first_line
from fitrl.demo import DemoArguments
from fitrl.distributed import cpu_only
from fitrl.ending import TrainingEnd, finish_training, samples_markdown
from fitrl.guards import HackingGuard, Health, check_prompts, check_stop_token, heldout_set, repetition
from fitrl.hf_trainer import (
    TrainerRun,
    quiet_progress,
    reference_guard,
    start_metrics,
    trainer_arguments,
    trainer_callbacks,
)
from fitrl.hf_trainer import train as train_with_guards
from fitrl.hub import push_output
from fitrl.memory import memory_report, peak_memory_mb
from fitrl.modeling import (
    GRPO_LORA_TARGETS,
    LoraArguments,
    ModelArguments,
    load_causal_lm,
    load_tokenizer,
    lora_config,
    resolve_model_path,
)
from fitrl.outputs import check_output_dir, staged_output_dir
from fitrl.planner import planned_peak_mb
from fitrl.process import entrypoint
from fitrl.reward import audit, probes
from fitrl.reward.functions import Checked, format_only, reward_functions, trl_keywords
from fitrl.rollout import complete_chats
from fitrl.stages.grpo import REPETITION_KEY, STAGE, GRPOArguments, monitors
from fitrl.tasks.answer_format import asks_for_answer_block, ensure_chat_template, render_prompt
from fitrl.tasks.grading import is_correct
from fitrl.tasks.gsm8k import GSM8KDataArguments, add_prompts, load_problems

# GRPOArguments that trl's GRPOConfig takes under the same name (the shared trainer ones aside).
GRPO_SETTINGS = [
    "adam_beta1",
    "adam_beta2",
    "num_generations",
    "max_completion_length",
    "temperature",
    "steps_per_generation",
    "generation_batch_size",
    "beta",
    "reward_weights",
    "num_iterations",
    "epsilon",
    "loss_type",
    "use_vllm",
    "vllm_gpu_memory_utilization",
]
CURVES = ["reward", "heldout/accuracy", "completions/mean_length", "kl"]  # and each reward function's mean


@dataclass
class Run(TrainerRun):
    """What lives for the whole run: configs, the problems as prompts, the trainer once built."""

    model_args: ModelArguments
    lora_args: LoraArguments
    data_args: GSM8KDataArguments
    args: GRPOArguments
    demo_args: DemoArguments
    model_path: str
    tokenizer: Any
    dataset: Any  # problems with their chat prompts
    reward_funcs: list[Checked]
    details: dict[str, Any]  # what preflight found, for run_info.json
    resume: str | None
    checkpoints_existed: bool
    training_args: Any = None  # trl's GRPOConfig
    heldout: Any = None  # the problems the reward-hacking guard grades (None: that guard is off)
    heldout_readings: HeldoutReadings | None = None  # that guard's readings, which the audit reads too
    shown: Any = None  # the problems whose greedy completions are shown before and after
    samples_before: list[str] = field(default_factory=list)

    @property
    def configs(self) -> tuple[Any, ...]:
        return (self.model_args, self.lora_args, self.data_args, self.args, self.demo_args)

    @property
    def is_main(self) -> bool:
        return self.training_args.process_index == 0


def preflight(configs: tuple[Any, ...]) -> Run:
    """Every input checked before the model loads (a typo should cost a second); the problems as prompts."""
    model_args, lora_args, data_args, args, demo_args = configs
    inputs = [model_args.model_name_or_path, data_args.dataset, args.resume_from_checkpoint]
    check_output_dir(args.output_dir, args.overwrite_output_dir, inputs, demo_args.demo_assets)
    resume = resume_checkpoint(
        args.resume_from_checkpoint, args.output_dir, STAGE.checkpoint_prefix, "GRPO", config_dict(*configs)
    )
    checkpoints_existed = checkpoint_root(args.output_dir).exists()
    model_path = resolve_model_path(model_args.model_name_or_path, demo_args.demo_assets)
    health = Health(strict=args.strict_guards)
    reward_funcs = reward_functions(args.reward_funcs, observe=lambda ids, log: log_repetition(ids, log, health))
    problems, skipped = load_problems(data_args, demo_args.demo_assets)
    tokenizer = load_tokenizer(model_path, model_args.trust_remote_code, padding_side="left")
    plain_template = ensure_chat_template(tokenizer)
    dataset, n_too_long = add_prompts(problems, tokenizer, data_args.system_prompt, data_args.max_prompt_length)
    check_enough_problems(len(dataset), args)
    for function in reward_funcs:  # a function trl could not call with these columns fails here, not mid-run
        function.check(dataset.column_names)
    if args.use_vllm and cpu_only():
        raise UsageError("use_vllm needs a CUDA GPU; set use_vllm false on this machine")
    details = {
        "problems": len(dataset),
        "skipped_non_numeric_gold": skipped,
        "dropped_long_prompts": n_too_long,
        "plain_chat_template": plain_template,
    }
    resume_path = str(resume) if resume else None
    run = Run(*configs, model_path, tokenizer, dataset, reward_funcs, details, resume_path, checkpoints_existed)
    run.health = health
    check_reward_kinds(args, run.health)
    run.heldout = heldout_problems(run)
    total = len(dataset) + n_too_long
    rendered = render_prompt(tokenizer, dataset[0]["prompt"])
    check_prompts(rendered, n_too_long, total, data_args.max_prompt_length, run.health)
    check_stop_token(tokenizer, stop_ids(model_path, tokenizer, model_args.trust_remote_code), run.health)
    details["first_prompt_rendered"] = rendered
    run.training_args = grpo_config(args, model_args)
    run.planned_peak_mb = planned_peak_mb(STAGE, configs, model_path, run.training_args.world_size)
    if run.is_main:
        print(
            f"GRPO: {len(dataset)} problems from {data_args.dataset} ({len(skipped)} skipped: gold not a number, "
            f"{n_too_long} dropped: prompt over {data_args.max_prompt_length} tokens)"
        )
        for row in skipped[:5]:
            print(f"  skipped row {row['row']}: gold answer {row['gold']!r} is not a number")
    return run


def build(run: Run) -> None:
    """The frozen base, greedy samples before training, and trl's `GRPOTrainer` with fitrl's rewards."""
    from transformers import set_seed
    from trl import GRPOTrainer

    args = run.args
    model, peft_config, run.details["lora_target_modules"] = load_base_and_lora(
        run.model_args, run.lora_args, args, run.model_path, run.tokenizer
    )
    run.shown = run.dataset.select(range(min(args.num_samples_to_show, len(run.dataset))))
    run.samples_before = [
        c[0] for c in complete_chats(model, run.tokenizer, run.shown["prompt"], args.max_completion_length)
    ]
    found = reward_preflight(run, model)
    if found is not None:
        run.details[probes.DETAILS_KEY] = found
    run.metrics = start_metrics(run.out, run.is_main, run.resume)
    set_seed(args.seed)  # the trainer builds the LoRA adapter from `peft_config`: seed its init
    run.trainer = GRPOTrainer(
        model=model,
        reward_funcs=run.reward_funcs,
        args=run.training_args,
        train_dataset=run.dataset,
        processing_class=run.tokenizer,
        peft_config=peft_config,
        callbacks=[
            *([heldout_callback(run)] if run.heldout is not None else []),  # first: its figure reaches the log
            *trainer_callbacks(
                run.configs,
                run.metrics,
                run.step_peak,
                args.output_dir,
                run.out,
                run.health,
                extra=lambda: {"peak_memory_mb": round(peak_memory_mb(), 1)},
                reward_std_key="reward_std",
                limits=monitors(args),
            ),
        ],
    )
    if args.beta > 0:  # the KL to the adapter-off reference, per token
        reference_guard(run.trainer, run.health, ["kl"], 1.0, "per token")
    keep_adapter_in_float32(run.trainer, run.model_args)
    quiet_progress(run.trainer)


def train(run: Run) -> None:
    """trl's loop, from the checkpoint to resume from if any (`fitrl.hf_trainer.train`)."""
    train_with_guards(run.trainer, run.metrics, run.resume, run.args.output_dir, run.checkpoints_existed)


def finish(run: Run) -> None:
    """The ranks agree; the adapter, settings, run_info, curves and before/after samples are written."""
    from peft import get_peft_model_state_dict

    trainer, args = run.trainer, run.args
    policy = trainer.accelerator.unwrap_model(trainer.model)
    after = []
    if trainer.is_world_process_zero():
        after = [c[0] for c in complete_chats(policy, run.tokenizer, run.shown["prompt"], args.max_completion_length)]
    rewards = [r["reward"] for r in run.metrics.rows if "reward" in r]
    k = max(1, len(rewards) // 5)
    first, last = (sum(rewards[:k]) / k, sum(rewards[-k:]) / k) if rewards else (0.0, 0.0)
    shown = zip(run.shown["question"], run.shown["gold"], run.samples_before, after)
    rows = [{"question": q, "gold": g, "before": b, "after": a} for q, g, b, a in shown]
    with run.health.timed():  # counted in guard_seconds with the guards' own work
        audited = overoptimisation(run)
    if audited is not None and run.is_main:  # a report figure, drawn (untimed) as the curves are
        audit.plot(audited, run.metrics.rows, "reward", audit_kl(run.metrics.rows), run.out / audit.PLOT)
    end = TrainingEnd(
        stage=STAGE.name,
        configs=run.configs,
        model_path=run.model_path,
        world_size=run.training_args.world_size,
        trained=get_peft_model_state_dict(policy),
        save_weights=lambda out: trainer.save_model(str(out)),
        tokenizer=run.tokenizer,
        trainable_parameters=sum(p.numel() for p in policy.parameters() if p.requires_grad),
        memory=memory_report(run.planned_peak_mb, run.step_peak),
        metrics=run.metrics.rows,
        curves=[*CURVES[:1], *(f"rewards/{f.__name__}/mean" for f in run.reward_funcs), *CURVES[1:]],
        plot=STAGE.plot,
        title=f"GRPO: {run.model_args.model_name_or_path}",
        summary=f"GRPO done: mean reward {first:.3f} (first {k} logs) -> {last:.3f} (last {k}) in {args.output_dir}",
        resumed_from=run.resume,
        health=run.health,
        details={**run.details, **({audit.DETAILS_KEY: audited.to_json()} if audited is not None else {})},
        samples=(STAGE.samples, samples_markdown("Greedy completions before and after GRPO", {"samples": rows})),
    )
    finish_training(end, run.out, trainer.is_world_process_zero())


def audit_kl(rows: list[dict[str, Any]]) -> str | None:
    """trl's KL metric when it logs one (`beta` > 0), else None."""
    return "kl" if any(isinstance(r.get("kl"), (int, float)) for r in rows) else None


def overoptimisation(run: Run) -> audit.Audit | None:
    """The over-optimisation audit (`fitrl.reward.audit`) of the held-out accuracy readings beside the
    training reward (against sqrt KL where trl logs one: `beta` > 0): the saved policy nearest the peak
    among this run's checkpoints (every `save_steps`) and its output."""
    args = run.args
    if run.heldout_readings is None:
        return None
    guard = run.heldout_readings.guard
    rows, final = run.metrics.rows, run.trainer.state.global_step
    kl = audit_kl(rows)
    readings = audit.readings(rows, guard.scores, "reward", kl)
    saved = audit.saved_policies(args.output_dir, STAGE.checkpoint_prefix, args.save_steps, final)
    command = (
        f"fitrl eval_gsm8k --adapter {{adapter_dir}} --output_dir {audit.peak_eval_dir(args.output_dir)} "
        f"--max_new_tokens {args.max_completion_length}"
    )
    gold = f"held-out accuracy (greedy, {len(run.heldout['prompt'])} problems)"
    return audit.audit(gold, readings, saved, final, args.output_dir, command)


def log_repetition(completion_ids: list[list[int]], log_metric: Any, health: Health) -> None:
    """Each batch's repeated 3-gram share, logged beside trl's metrics for the repetition monitor."""
    with health.timed():
        value = repetition(completion_ids)
    if value == value:  # NaN: no completion long enough to repeat itself
        log_metric(REPETITION_KEY, value)


def reward_preflight(run: Run, model: Any) -> dict[str, Any] | None:
    """The reward pre-flight (`fitrl.reward.probes`): the model's greedy completions to the first
    `guard_probe_prompts` problems beside degenerate ones, scored by the weighted reward functions as trl
    sums them (None as 0), before the first update; the run's random streams left as they were."""
    args, health = run.args, run.health
    if args.guard_probe_prompts == 0 or run.resume is not None:
        health.not_run(probes.GUARD, "guard_probe_prompts is 0" if args.guard_probe_prompts == 0 else "resumed")
        return None
    rows = run.dataset.select(range(min(args.guard_probe_prompts, len(run.dataset))))
    weights = args.reward_weights or [1.0] * len(run.reward_funcs)
    columns = {k: rows[k] for k in rows.column_names if k != "prompt"}
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))), health.timed():
        references = [c[0] for c in complete_chats(model, run.tokenizer, rows["prompt"], args.max_completion_length)]

        def score(indices: list[int], texts: list[str]) -> list[float]:
            chats = [[{"role": "assistant", "content": t}] for t in texts]
            ids = [run.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
            keywords = trl_keywords([rows["prompt"][i] for i in indices], ids)
            cols = {k: [v[i] for i in indices] for k, v in columns.items()}
            totals = [0.0] * len(texts)
            for weight, function in zip(weights, run.reward_funcs):
                for j, value in enumerate(function(chats, **keywords, **cols)):
                    totals[j] += weight * (value or 0.0)
            return totals

        answer_format = asks_for_answer_block(run.data_args.system_prompt)
        found = probes.run_probes(score, rows["question"], references, False, answer_format)
    probes.check_probes(found, health, args.guard_probe_max)
    return found.to_json()


def heldout_problems(run: Run) -> Any:
    """The problems the reward-hacking guard grades: `guard_heldout_split` of the data, never trained on."""
    args, data_args = run.args, run.data_args
    heldout = dataclasses.replace(
        data_args, dataset_split=args.guard_heldout_split, max_samples=args.guard_heldout_problems
    )

    def load() -> Any:
        problems, _ = load_problems(heldout, run.demo_args.demo_assets)
        return add_prompts(problems, run.tokenizer, data_args.system_prompt, data_args.max_prompt_length)[0]

    off = "guard_heldout_every is 0" if args.guard_heldout_every == 0 else None
    fix = "set guard_heldout_split to a held-out split, or guard_heldout_every 0"
    return heldout_set(run.health, off, load, fix)


HELDOUT_STATE = "heldout_guard.json"  # in each checkpoint: the reward-hacking guard's readings so far


def heldout_batch(args: GRPOArguments, world: int) -> int:
    """Held-out problems per generate call: no more than this process's generation batch in training,
    which the memory plan holds (and at most 32)."""
    per_step = args.steps_per_generation or args.gradient_accumulation_steps
    size = (
        args.generation_batch_size // world
        if args.generation_batch_size
        else args.per_device_train_batch_size * per_step
    )
    return max(1, min(32, size))


def heldout_accuracy(run: Run, model: Any, batch_size: int) -> float:
    """The policy's greedy accuracy on the held-out problems."""
    prompts, golds = run.heldout["prompt"], run.heldout["gold"]
    completions = complete_chats(model, run.tokenizer, prompts, run.args.max_completion_length, batch_size=batch_size)
    return sum(is_correct(c[0], g) for c, g in zip(completions, golds)) / len(completions)


def restore_heldout(guard: HackingGuard, resume: str | None) -> bool:
    """The guard's readings from the checkpoint a run resumes (a resumed run reads on the uninterrupted
    run's schedule, against the same first reading); False where there are none."""
    saved = Path(resume) / HELDOUT_STATE if resume else None
    if saved is None or not saved.is_file():
        return False
    guard.load_state_dict(json.loads(saved.read_text()))
    return True


class HeldoutReadings:
    """The reward-hacking guard's held-out accuracy (greedy) at the start, every `guard_heldout_every`
    steps and at the end, against the logged training reward; each reading but the end's logged as
    `heldout/accuracy` with its step's row (no row is logged after the end)."""

    def __init__(self, run: Run) -> None:
        args = run.args
        self.run, self.every = run, args.guard_heldout_every
        self.guard = HackingGuard(
            run.health, "held-out accuracy", args.guard_heldout_drop, "check what the rewards pay for, or set beta > 0"
        )
        self.size = heldout_batch(args, run.training_args.world_size)
        self.pending: float | None = None  # measured at a step's end, logged with that step's row

    def measure(self, model: Any, step: int) -> None:
        with self.run.health.timed():
            self.pending = heldout_accuracy(self.run, model, self.size)
            self.guard.score(step, self.pending)

    def begin(self, model: Any, step: int) -> None:
        if not restore_heldout(self.guard, self.run.resume):
            self.measure(model, step)

    def step_end(self, model: Any, step: int) -> None:
        if step % self.every == 0:
            self.measure(model, step)

    def log(self, logs: dict | None) -> None:
        if "reward" in (logs or {}):
            self.guard.reward(logs["reward"])
            if self.pending is not None:
                logs["heldout/accuracy"], self.pending = self.pending, None

    def end(self, model: Any, step: int) -> None:
        if self.guard.unread(step):
            self.measure(model, step)
        self.guard.finish()


def heldout_callback(run: Run) -> Any:
    """`HeldoutReadings` on trl's loop; each checkpoint keeps its readings so far (`HELDOUT_STATE`)."""
    from transformers import TrainerCallback

    readings = run.heldout_readings = HeldoutReadings(run)

    class _Heldout(TrainerCallback):
        def on_train_begin(self, args_: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            readings.begin(model, state.global_step)

        def on_save(self, args_: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.is_world_process_zero:  # before the checkpoint's last file (`checkpoint_extras`)
                path = Path(args_.output_dir) / f"checkpoint-{state.global_step}" / HELDOUT_STATE
                path.write_text(json.dumps(readings.guard.state_dict()))

        def on_step_end(self, args_: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            readings.step_end(model, state.global_step)

        def on_log(self, args_: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            readings.log(logs)

        def on_train_end(self, args_: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            readings.end(model, state.global_step)

    return _Heldout()


def stop_ids(model_path: str, tokenizer: Any, trust_remote_code: bool) -> list[int]:
    """The tokens generation stops at, as trl's `GRPOTrainer` takes them: the model's generation config's
    EOS ids, and the tokenizer's EOS."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json: the model config's
        eos = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def check_reward_kinds(args: GRPOArguments, health: Health) -> None:
    """Rewards that score only the format, with no KL term to hold the policy near its start, are gamed:
    an empty reasoning block and a bare number earn them in full (FAI-RL#96)."""
    if format_only(args.reward_funcs) and args.beta == 0:
        health.failed(
            "format_only",
            f"every reward ({', '.join(args.reward_funcs)}) scores only the format and beta is 0: the policy "
            "usually learns the format with empty or made-up content; add a reward for the content (accuracy) "
            "or set beta > 0",
            0,
        )
    else:
        health.passed("format_only", f"rewards {', '.join(args.reward_funcs)}, beta {args.beta:g}")


def keep_adapter_in_float32(trainer: Any, model_args: ModelArguments) -> None:
    """trl stores a quantized model's adapter in bf16 (the QLoRA-on-GPU convention); with a float32
    compute dtype (the CPU demo) small updates would round away, so keep the adapter in float32."""
    if model_args.dtype == "float32":
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()


def load_base_and_lora(model_args: Any, lora_args: Any, args: Any, model_path: str, tokenizer: Any) -> tuple:
    """The frozen (quantized) base, and the LoRA config trl wraps it with (the blog's targets by default)."""
    model = load_causal_lm(
        model_args,
        path=model_path,
        gradient_checkpointing=args.gradient_checkpointing,
        pad_token_id=tokenizer.pad_token_id,
    )
    targets = lora_args.lora_target_modules or GRPO_LORA_TARGETS.get(model.config.model_type, ["all-linear"])
    peft_config = lora_config(dataclasses.replace(lora_args, lora_target_modules=targets), model.config.model_type)
    return model, peft_config, targets


def check_enough_problems(n: int, args: GRPOArguments) -> None:
    """Refuse a data set that fills less than one optimizer step, before the model loads: trl would run 0
    steps (and exit 0), or with max_steps find no batch at all."""
    from fitrl.distributed import process_state

    completions = args.per_device_train_batch_size * args.gradient_accumulation_steps * process_state().num_processes
    needed = -(-completions // args.num_generations)
    if n < needed:
        raise UsageError(
            f"{n} problems fill less than one optimizer step ({needed} problems x num_generations "
            f"{args.num_generations} = per_device_train_batch_size x gradient_accumulation_steps x processes); "
            "give more problems, or lower per_device_train_batch_size or gradient_accumulation_steps"
        )


def grpo_config(args: GRPOArguments, model_args: ModelArguments) -> Any:
    """trl's `GRPOConfig`: the shared trainer settings plus GRPO's own; trl's refusals are usage errors."""
    from trl import GRPOConfig

    try:
        return GRPOConfig(
            **{key: getattr(args, key) for key in GRPO_SETTINGS},
            vllm_mode="colocate",
            **trainer_arguments(args, model_args, output_dir=str(checkpoint_root(args.output_dir))),
        )
    except ValueError as e:  # batch sizes that do not divide into groups, and the like
        raise UsageError(first_line(e)) from None


@entrypoint
def main(argv: list[str] | None = None) -> None:
    run = preflight(STAGE.parse(argv))
    with staged_output_dir(run.args.output_dir, run.args.overwrite_output_dir, stage=STAGE.name) as run.out:
        build(run)
        train(run)
        finish(run)
    push_output(run.args, run.args.output_dir, STAGE.name)


if __name__ == "__main__":
    main()
