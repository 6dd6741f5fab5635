"""The memory planner: exact static bytes, plans within 10% of real steps, the documented anchors, the CLI."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fitrl import planner, stages
from fitrl.architectures import architecture
from fitrl.config import UsageError
from fitrl.memory import LiveTensorBytes, optimizer_state_tensors, tensor_bytes
from fitrl.memtrace import build_trainable, measure_step, trace_step
from fitrl.modeling import LoraArguments, ModelArguments, add_lora, load_causal_lm, make_optimizer
from fitrl.workload import Step, Workload

from conftest import CONFIGS, run_main, run_script

GiB = planner.GiB


def tiny_config(kind: str, layers: int = 5):
    from transformers import GPTNeoXConfig, LlamaConfig

    if kind == "llama":
        return LlamaConfig(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=2048,
            max_position_embeddings=512,
        )
    return GPTNeoXConfig(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        vocab_size=2048,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    out = {}
    for kind in ["llama", "neox"]:
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(kind)
        AutoModelForCausalLM.from_config(tiny_config(kind)).save_pretrained(path)
        out[kind] = path
    return out


def test_tracker_counts_fresh_storage_once_and_frees_it() -> None:
    weight = torch.ones(1000)  # exists before: never counted
    tracker = LiveTensorBytes()
    with tracker:
        view = weight.view(10, 100)  # a view of an existing tensor: 0 bytes
        a = weight * 2  # 4000 bytes
        a.add_(1)  # in place: 0 bytes
        b = torch.cat([a, a])  # 8000 bytes
        assert tracker.current == 12_000
        del a, b
        assert tracker.current == 0
        with tracker.phase("p"):
            c = torch.zeros(250, dtype=torch.float64)  # 2000 bytes
            del c
    assert (tracker.peak, tracker.phase_peaks["p"], view.shape) == (12_000, 2000, (10, 100))
    assert tensor_bytes([weight, weight.view(-1), weight[:10]]) == 4000


def _held_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Real bytes of the frozen base (with bitsandbytes' scales and quant states) and of the trainable tensors."""
    frozen, trainable = [], []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            (trainable if p.requires_grad else frozen).append(p)
            for attr in ["CB", "SCB"]:
                if isinstance(getattr(p, attr, None), torch.Tensor):
                    frozen.append(getattr(p, attr))
            state = getattr(p, "quant_state", None)
            while state is not None:
                frozen += [t for t in vars(state).values() if isinstance(t, torch.Tensor)]
                state = getattr(state, "state2", None)
        frozen += list(module.buffers(recurse=False))
    return tensor_bytes(frozen), tensor_bytes(trainable)


@pytest.mark.parametrize("kind", ["llama", "neox"])
@pytest.mark.parametrize(
    "quantization,dtype,optimizer",
    [
        ("none", "float32", "adamw"),
        ("none", "bfloat16", "adamw"),
        ("8bit", "float16", "adamw_8bit"),
        ("4bit", "bfloat16", "paged_adamw_8bit"),
    ],
)
def test_static_bytes_equal_the_real_tensors(
    saved_models: dict[str, Path], kind: str, quantization: str, dtype: str, optimizer: str
) -> None:
    path = saved_models[kind]
    targets = ["q_proj", "v_proj", "down_proj"] if kind == "llama" else ["query_key_value", "dense_4h_to_h"]
    model = load_causal_lm(ModelArguments(str(path), quantization, dtype), path=str(path))
    model = add_lora(model, LoraArguments(lora_r=8, lora_target_modules=targets))
    real_weights, real_trainable = _held_bytes(model)
    opt = make_optimizer(model, optimizer)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()

    w = Workload(
        "sft",
        Step.NEXT_TOKEN,
        quantization=quantization,
        dtype=dtype,
        lora_r=8,
        lora_targets=tuple(targets),
        optimizer=optimizer,
    )
    planned = planner.static_bytes(tiny_config(kind), w)
    assert planned["weights"] == real_weights
    assert planned["trainable_params"] == real_trainable
    assert planned["gradients"] == real_trainable  # fp32 gradients of fp32 adapter weights
    assert planned["optimizer_states"] == tensor_bytes(optimizer_state_tensors(opt))


def _loaded_bytes(model: torch.nn.Module) -> int:
    """Every tensor a loaded model holds, bitsandbytes' scales included (8-bit: a float per row, `SCB`;
    4-bit: its quant state's absmax, nested absmax and offset)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        state = getattr(t, "quant_state", None)
        extras = [getattr(t, "SCB", None)]
        if state is not None:
            extras += [state.absmax, getattr(state, "offset", None), state.state2.absmax if state.state2 else None]
        total += sum(x.numel() * x.element_size() for x in [t, *extras] if isinstance(x, torch.Tensor))
    return total


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "8bit"), ("bfloat16", "4bit")]
)
def test_the_reward_model_is_planned_as_it_loads(demo_assets: Path, dtype: str, quantization: str) -> None:
    """PPO's reward classifier in each precision: the planned bytes are what loading it holds (within 1%)."""
    from fitrl.modeling import load_classifier
    from fitrl.stages.base import RewardModel

    model, _ = load_classifier(str(demo_assets / "classifier"), dtype, quantization)
    planned = planner.reward_model_bytes(RewardModel(str(demo_assets / "classifier"), dtype, quantization))
    assert planned == pytest.approx(_loaded_bytes(model), rel=0.01)


def test_full_finetuning_static_bytes_equal_the_real_tensors() -> None:
    config = tiny_config("llama")
    w = Workload("sft", Step.NEXT_TOKEN, dtype="bfloat16", finetuning="full", optimizer="adamw")
    model = build_trainable(config, w, "cpu")
    opt = make_optimizer(model, "adamw")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    planned = planner.static_bytes(config, w)
    params = {id(p): p for p in model.parameters()}.values()
    assert planned["weights"] == tensor_bytes([*params, *model.buffers()])
    assert planned["gradients"] == tensor_bytes(params)
    assert planned["optimizer_states"] == tensor_bytes(optimizer_state_tensors(opt))


WORKLOADS = {
    "sft-lora": Workload("sft", Step.NEXT_TOKEN, dtype="float32", micro_batch=4, completion_len=128),
    "sft-full": Workload("sft", Step.NEXT_TOKEN, dtype="float32", finetuning="full", micro_batch=2, completion_len=128),
    "sft-bf16-checkpointing": Workload(
        "sft", Step.NEXT_TOKEN, dtype="bfloat16", gradient_checkpointing=True, micro_batch=4, completion_len=128
    ),
    "ppo": Workload(
        "ppo",
        Step.PPO,
        dtype="float32",
        micro_batch=8,
        prompt_len=8,
        completion_len=24,
        gen_batch=16,
        nograd_batch=16,
        reference_pass=True,
        value_head=True,
    ),
    "grpo": Workload(
        "grpo",
        Step.GRPO,
        dtype="float32",
        gradient_checkpointing=True,
        micro_batch=4,
        prompt_len=32,
        completion_len=64,
        gen_batch=8,
        reference_pass=True,
    ),
    # a reward model: a sequence classifier whose score head trains with the adapter; pairs as 2 x 4 texts
    "rm": Workload("rm", Step.PAIRWISE_SCORE, dtype="float32", micro_batch=8, completion_len=48),
    # DPO: the policy's pass on 2 x 4 texts, then the reference's (adapter off) inside the same step
    "dpo": Workload("dpo", Step.DPO, dtype="float32", micro_batch=8, completion_len=48, reference_pass=True),
}


@pytest.mark.parametrize("kind", ["llama", "neox"])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_plan_is_within_10_percent_of_a_measured_step(kind: str, name: str) -> None:
    """Planned tensor bytes at each phase's peak vs the same step run on real CPU tensors."""
    config, w = tiny_config(kind), WORKLOADS[name]
    plan = planner.plan(config, w, on_gpu=False)
    torch.manual_seed(0)
    measured = measure_step(build_trainable(config, w, "cpu"), w, "cpu")
    assert set(measured) == set(plan.phase_bytes)
    for phase, real in measured.items():
        assert abs(plan.phase_bytes[phase] / real - 1) < 0.10, (phase, plan.phase_bytes[phase], real)


def test_depth_extrapolation_agrees_with_the_full_depth_trace() -> None:
    config, w = tiny_config("llama", layers=6), WORKLOADS["ppo"]
    plan = planner.plan(config, w, on_gpu=False)
    traced = planner.trace_full_depth(config, w)
    for phase, bytes_ in traced.items():
        assert abs(plan.phase_bytes[phase] / bytes_ - 1) < 0.10, phase


@pytest.mark.parametrize(
    ("kind", "completion_len", "gen_batch"),
    # the last decode step holds the peak at every depth; only from the third block on (llama 24/16,
    # neox 12/32: extrapolating the larger of the two parts from two and three blocks was 28% / 21% low)
    [("llama", 40, 64), ("neox", 40, 64), ("llama", 24, 16), ("neox", 12, 32)],
)
def test_generation_peak_from_prefill_and_last_decode_step_equals_every_step_traced(
    kind: str, completion_len: int, gen_batch: int
) -> None:
    config = tiny_config(kind, layers=6)
    w = replace(WORKLOADS["ppo"], completion_len=completion_len, gen_batch=gen_batch)
    every_step = trace_step(build_trainable(config, w, "meta"), w, "meta")
    planned = planner.dynamic_bytes(config, w)  # two- and three-block traces, prefill and last step apart
    assert planned["generation"] == every_step["generation"]
    assert set(planned) == set(every_step)


def test_meta_trace_allocates_nothing_for_a_20b_model() -> None:
    config = architecture("EleutherAI/gpt-neox-20b")
    w = Workload(
        "sft",
        Step.NEXT_TOKEN,
        quantization="8bit",
        dtype="float16",
        lora_targets=("query_key_value",),
        completion_len=16,
    )
    model = build_trainable(config, w, "meta", num_layers=2)
    assert all(p.is_meta for p in model.parameters())
    peaks = trace_step(model, w, "meta")
    assert peaks["training step"] > 0


def test_kv_cache_for_long_completions_matches_unsloths_order_of_magnitude() -> None:
    # Unsloth's GRPO breakdown for Llama-3.1-8B at 20K context quotes a 2.5 GB KV cache (bf16, one sequence).
    config = architecture("meta-llama/Llama-3.1-8B")
    w = Workload("grpo", Step.GRPO, dtype="bfloat16", prompt_len=0, completion_len=20_000, gen_batch=1)
    assert planner.kv_cache_bytes(config, w) == 2 * 32 * 20_000 * 8 * 128 * 2  # 2.62 GB
    assert 2.0e9 < planner.kv_cache_bytes(config, w) < 3.0e9


def _cli(*args: str) -> tuple[int, dict]:
    """`plan.py ... --json` as a user runs it, in this process: one 20B architecture is traced once
    for the calls that share its shapes, not once per subprocess."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = run_main("plan.py", *args, "--json")
    assert code in (0, 1), out.getvalue()[-2000:]
    return code, json.loads(out.getvalue())


@pytest.mark.slow
def test_neox20b_profiles_fit_an_rtx_4090_not_16gb_and_suggest_a_4bit_base() -> None:
    """The profile's card as torch sees it (23.64 GiB, not 24), with the plan's own CUDA context and
    allocator slack inside the peak."""
    neox = ["--architecture", "EleutherAI/gpt-neox-20b"]
    for stage in ["sft", "rm", "ppo", "dpo"]:
        # rm, ppo and dpo load the merge's output, not written yet: planned as the model the merge reads
        code, fits24 = _cli("--config", CONFIGS / "neox20b-24gb" / f"{stage}.yaml", "--gpu", "RTX 4090")
        assert code == 0 and fits24["fits"], fits24
        assert fits24 == _cli("--config", CONFIGS / "neox20b-24gb" / f"{stage}.yaml", *neox, "--gpu", "RTX 4090")[1]
        assert fits24["gpu_memory_bytes"] == int(23.64 * GiB)
        assert 19.5 * GiB < fits24["components"]["weights"] < 21.5 * GiB  # 8-bit weights, fp32 embeddings
        for key in ["stage", "model", "gpu_memory_bytes", "peak_bytes", "peak_phase", "components"]:
            assert key in fits24
        assert {"weights", "trainable_params", "gradients", "optimizer_states"} <= set(fits24["components"])
        assert sum(fits24["components"].values()) == fits24["peak_bytes"]
    # PPO against a 20B reward model as an rm adapter on the policy's own backbone: it fits, no second
    # model counted (loaded separately, in fp32 as a classifier is, it would add 75 GiB: docs/stages.md)
    ppo = ["--config", CONFIGS / "neox20b-24gb" / "ppo.yaml", *neox, "--gpu", "RTX 4090"]
    code, shared = _cli(*ppo, "--reward_adapter", "outputs/neox20b-24gb/rm")
    assert code == 0 and shared["fits"] and shared["components"]["reward_model"] == 0, shared
    code, at16 = _cli("--config", CONFIGS / "neox20b-24gb" / "sft.yaml", *neox, "--gpu_memory_gb", "16", "--suggest")
    assert code == 1 and not at16["fits"]
    assert at16["suggestions"][0] == {"quantization": "4bit"}  # the nearest change first, in the stage's keys
    assert at16["suggested_peak_bytes"][0] <= 16 * GiB


@pytest.mark.slow
def test_llama1b_grpo_profile_fits_a_16gb_laptop_card_and_full_finetuning_needs_twice_as_much() -> None:
    grpo = ["--config", CONFIGS / "llama1b-16gb" / "grpo.yaml", "--gpu", "RTX 3080 Laptop 16GB"]
    code, lora = _cli(*grpo)
    assert code == 0 and lora["fits"]
    _, full = _cli(*grpo, "--finetuning", "full")
    assert full["peak_bytes"] >= 2 * lora["peak_bytes"]


@pytest.mark.slow
def test_every_qwen_profile_stage_fits_the_smallest_16gb_desktop_card() -> None:
    """Qwen2.5-0.5B-Instruct's whole menu on an RTX 4060 Ti 16GB (15.55 GiB as torch sees it), PPO with
    its reward model on the policy's own backbone."""
    qwen = ["--architecture", "Qwen/Qwen2.5-0.5B-Instruct", "--gpu", "RTX 4060 Ti 16GB"]
    peaks = {}
    for stage in ["sft", "rm", "ppo", "dpo", "grpo"]:
        code, plan = _cli("--config", CONFIGS / "qwen0.5b-16gb" / f"{stage}.yaml", *qwen)
        assert code == 0 and plan["fits"] and plan["gpu_memory_bytes"] == int(15.55 * GiB), (stage, plan)
        assert 0.9 * GiB < plan["components"]["weights"] < 1.1 * GiB, plan  # 494M parameters in bf16
        peaks[stage] = plan["peak_bytes"]
        if stage == "ppo":
            assert plan["components"]["reward_model"] == 0, plan
    assert max(peaks.values()) < 8 * GiB, peaks  # room to spare: a 1.5B model is the next step up


def test_cli_traces_the_demo_and_prints_a_table(demo_assets: Path) -> None:
    result = run_script("plan.py", "--config", CONFIGS / "demo" / "sft.yaml", "--demo_assets", demo_assets, "--trace")
    assert result.returncode == 0, result.stderr
    assert "traced at full depth on meta" in result.stdout and "verdict: fits" in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--stage", "sft", "--model_name_or_path", "nobody/no-such-model"], "cannot plan for model"),
        (["--config", "configs/demo/sft.yaml", "--lora_target_modules", "nope"], "matches no linear layer"),
        (["--config", "configs/demo/grpo.yaml", "--max_completion_length", "-4"], "max_completion_length"),
        (["--config", "configs/demo/grpo.yaml", "--num_generations", "3"], "num_generations"),
        (["--config", "configs/demo/sft.yaml", "--gpu_memory_gb", "0"], "gpu_memory_gb"),
        (["--stage", "bogus"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, demo_assets: Path) -> None:
    result = run_script("plan.py", *args, "--demo_assets", demo_assets)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_full_finetuning_of_a_quantized_base_is_refused() -> None:
    config = tiny_config("llama")
    with pytest.raises(UsageError, match="full fine-tuning of a quantized base"):
        stage = stages.get("sft")
        configs = stage.parse(["--quantization", "8bit", "--per_device_train_batch_size", "1", "--block_size", "64"])
        planner.plan_stage(stage, configs, config, finetuning="full")


def test_memory_table_marks_what_fits(capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory_table", CONFIGS.parent / "bench" / "memory_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.table("sft", ["Qwen/Qwen2.5-0.5B"])
    row = next(line for line in text.splitlines() if line.startswith("| Qwen2.5-0.5B"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert len(cells) == 4 and all(c.endswith("✓✓✓✓") for c in cells), row  # 0.5B fits 16 GB in every mode
    full, lora = (float(c.split()[0]) for c in cells[:2])
    assert full > 1.5 * lora  # full fine-tuning holds gradients and Adam states for every weight


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--gpu", "NVIDIA GeForce RTX 4090"], "fits in 23.64 GiB"),
        (["--gpu", "t4", "--reserve_gb", "0.5"], "fits in 14.06 GiB"),
        (["--gpu", "NVIDIA GeForce RTX 4060 Ti 16GB"], "fits in 15.55 GiB"),
        (["--gpu", "RTX 5090"], "error: unknown card 'RTX 5090' (known: RTX 4090"),
        (["--gpu", "RTX 3080 Laptop"], "fits in 15.73 GiB"),  # a unique start of a card's name
        (["--gpu", "A100"], "error: card 'A100' could be A100 40GB or A100 80GB; give more of its name"),
        (["--gpu", "T4", "--gpu_memory_gb", "16"], "error: give --gpu or --gpu_memory_gb, not both"),
        (["--gpu", "T4", "--reserve_gb", "15"], "error: --reserve_gb 15.0 leaves nothing"),
        (["--gpu", "T4", "--reserve_gb", "nan"], "error: invalid value for '--reserve_gb'"),
    ],
)
def test_a_named_card_is_planned_at_what_torch_reports(
    args: list[str], expected: str, demo_assets: Path, capsys: pytest.CaptureFixture
) -> None:
    code = run_main("plan.py", "--config", CONFIGS / "demo" / "sft.yaml", "--demo_assets", demo_assets,
                    "--brief", *args)  # fmt: skip
    out = capsys.readouterr()
    assert code == (2 if expected.startswith("error") else 0)
    assert expected in (out.err if expected.startswith("error") else out.out)
