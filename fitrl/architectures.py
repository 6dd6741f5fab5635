"""Model architectures by name, for planning before anything downloads: a local directory, a demo
asset, a shipped `config.json` (`fitrl/model_configs/`) or the hub cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fitrl.config import UsageError, first_line

MODEL_CONFIGS = Path(__file__).parent / "model_configs"
# Hub ids whose config.json ships with fitrl, so planning needs no download.
KNOWN_MODELS = {
    "EleutherAI/gpt-neox-20b": "gpt-neox-20b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
    "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b",
    "Qwen/Qwen2.5-1.5B": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b",
    "Qwen/Qwen2.5-3B": "qwen2.5-3b",
    "Qwen/Qwen2.5-3B-Instruct": "qwen2.5-3b",
    "Qwen/Qwen2.5-7B": "qwen2.5-7b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
    "Qwen/Qwen2.5-14B": "qwen2.5-14b",
    "Qwen/Qwen2.5-14B-Instruct": "qwen2.5-14b",
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
    "Qwen/Qwen3-1.7B": "qwen3-1.7b",
    "Qwen/Qwen3-4B": "qwen3-4b",
    "Qwen/Qwen3-8B": "qwen3-8b",
    "mistralai/Mistral-7B-v0.1": "mistral-7b",
    "mistralai/Mistral-7B-Instruct-v0.2": "mistral-7b",
    "google/gemma-2-2b": "gemma-2-2b",
    "google/gemma-2-2b-it": "gemma-2-2b",
    "lvwerra/distilbert-imdb": "distilbert-imdb",
}


def architecture(name_or_path: str, demo_assets: str | None = None) -> Any:
    """The `PretrainedConfig` of a model: a local directory, a demo asset, a shipped config or the hub cache."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from fitrl import demo

    if demo.is_demo_uri(name_or_path):
        name_or_path = str(demo.resolve(name_or_path, demo_assets or ""))
    path = Path(name_or_path).expanduser()
    if (path / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(path, trust_remote_code=False)  # never ask, never run its code
        except (OSError, ValueError, KeyError) as e:  # malformed JSON, custom code (auto_map), unknown type
            raise UsageError(
                f"cannot plan for model {path}: its config.json cannot be read ({first_line(e)})"
            ) from None
        except StrictDataclassError as e:  # values transformers 5 refuses (hidden size not divisible by heads)
            raise UsageError(
                f"cannot plan for model {path}: transformers refuses its config.json ({first_line(e.__cause__ or e)})"
            ) from None
    shipped = KNOWN_MODELS.get(name_or_path)
    if shipped is not None:
        values = json.loads((MODEL_CONFIGS / f"{shipped}.json").read_text())
        return AutoConfig.for_model(values.pop("model_type"), **values)
    try:
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError):
        pass
    hint = "it does not exist yet" if path.is_absolute() or name_or_path.startswith(".") else "no config.json found"
    raise UsageError(
        f"cannot plan for model {name_or_path}: {hint}; give a local model directory, a hub id in the hub cache, "
        f"or --architecture with a shipped one (e.g. EleutherAI/gpt-neox-20b; all {len(KNOWN_MODELS)}: docs/memory.md)"
    )
