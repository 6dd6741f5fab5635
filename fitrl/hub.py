"""Shipping a result: a stage's finished output folder uploaded to the Hugging Face hub.

Every stage that writes a model or an adapter (sft, merge, rm, ppo, dpo, grpo) takes `HubSettings`.
The checks that need no network (a repo id, a token, the hub not switched off) run when the config is
read, before anything loads; the upload runs once the output is complete and in its place, so a failed
upload leaves the output on disk and says how to push it again.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from fitrl.config import RunFailed, UsageError, first_line, help_field

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass
class HubSettings:
    """Where a finished output goes on the hub (fields of every stage that writes a model or adapter)."""

    push_to_hub: bool = help_field(
        False, "Upload the finished output folder (weights, model card, settings, figures) to hub_model_id."
    )
    hub_model_id: str | None = help_field(None, "The hub model repo to upload to, 'owner/name' (created if missing).")
    hub_private: bool = help_field(True, "Create the repo private (a repo that exists keeps its visibility).")

    def validate(self) -> None:
        if not self.push_to_hub:
            return
        if not self.hub_model_id or not REPO_ID.match(self.hub_model_id):
            raise UsageError(f"push_to_hub needs hub_model_id as owner/name (got {self.hub_model_id!r})")
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            raise UsageError("push_to_hub needs the hub, but HF_HUB_OFFLINE is set; unset it or set push_to_hub false")
        from huggingface_hub import get_token

        if get_token() is None:
            raise UsageError("push_to_hub needs a hub token; run `hf auth login` or set HF_TOKEN")


def push_output(settings: HubSettings, output_dir: str | Path, stage: str) -> str | None:
    """Upload the finished `output_dir` to `settings.hub_model_id` (on the main process); its URL, or None
    when nothing was pushed. A failure is a `RunFailed` that keeps the output and says how to retry."""
    from fitrl.distributed import process_state

    if not settings.push_to_hub or not process_state().is_main_process:
        return None
    from huggingface_hub import HfApi

    out, repo = Path(output_dir), settings.hub_model_id
    try:
        api = HfApi()
        api.create_repo(repo, private=settings.hub_private, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo,
            folder_path=out,
            commit_message=f"fitrl {stage}: {out.name}",
            ignore_patterns=["runs/**"],  # tracker logs: large, and not part of the model
        )
    except Exception as e:  # any failure of the network or the hub: the output stays where it is
        raise RunFailed(
            f"the {stage} output is complete in {out}, but pushing it to {repo} failed ({type(e).__name__}: "
            f"{first_line(e)}); push it again with `hf upload {repo} {out}`"
        ) from None
    print(f"pushed {out} to {commit.repo_url}")
    return str(commit.repo_url)
