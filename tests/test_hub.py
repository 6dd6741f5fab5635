"""Shipping a result (`fitrl.hub`): a finished output uploaded to the hub, tested against a local
stand-in of the hub's HTTP API (the three calls an upload makes), never the network."""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fitrl.config import RunFailed, UsageError
from fitrl.hub import HubSettings, push_output

from conftest import CONFIGS, run_script


class StandIn(ThreadingHTTPServer):
    """What the hub answers to create a repo and commit files to it; it keeps what it was sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos: dict[str, dict] = {}  # repo id: {"visibility": ..., "files": {path: bytes}}
        self.fail_commits = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        assert self.headers.get("Authorization") == "Bearer hf_standin", self.headers.get("Authorization")
        if self.path == "/api/repos/create":
            request = json.loads(body)
            repo = f"{request['organization']}/{request['name']}"
            self.server.repos.setdefault(repo, {"visibility": request.get("visibility"), "files": {}})
            return self._answer(200, {"url": f"{self.server.url}/{repo}"})
        if self.path == "/api/validate-yaml":  # the model card's metadata, checked before the commit
            return self._answer(200, {})
        parts = self.path.removeprefix("/api/").split("/")
        if len(parts) != 5:
            return self._answer(404, {"error": f"the stand-in hub has no {self.path}"})
        _kind, owner, name, action, _revision = parts
        repo = f"{owner}/{name}"
        if action == "preupload":  # every file goes inline in the commit: no LFS
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                     for f in json.loads(body)["files"]]  # fmt: skip
            return self._answer(200, {"files": files})
        if self.server.fail_commits:
            return self._answer(403, {"error": "you cannot write to this repo"})
        for line in body.decode().splitlines():
            entry = json.loads(line)
            if entry["key"] == "file":
                value = entry["value"]
                self.server.repos[repo]["files"][value["path"]] = base64.b64decode(value["content"])
        return self._answer(200, {"commitUrl": f"{self.server.url}/{repo}/commit/1", "commitOid": "1" * 40})


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandIn]:
    server = StandIn()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    yield server
    server.shutdown()


@pytest.mark.slow
def test_a_finished_sft_output_lands_in_the_hub_repo_whole(tmp_path: Path, demo_assets: Path, hub: StandIn) -> None:
    out = tmp_path / "sft"
    result = run_script(
        "sft.py",
        *["--config", CONFIGS / "demo" / "sft.yaml", "--demo_assets", demo_assets, "--output_dir", out],
        *["--max_steps", "1", "--push_to_hub", "true", "--hub_model_id", "me/my-sft"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"pushed {out} to {hub.url}/me/my-sft" in result.stdout
    repo = hub.repos["me/my-sft"]
    assert repo["visibility"] == "private"
    written = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert repo["files"] == written  # every file, byte for byte
    assert "adapter_model.safetensors" in written and "library_name: peft" in written["README.md"].decode()


def test_a_failed_push_keeps_the_output_and_says_how_to_push_again(
    tmp_path: Path, hub: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)  # this process imported the hub's settings already
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    out = tmp_path / "ppo"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"weights")
    hub.fail_commits = True
    with pytest.raises(RunFailed) as failed:
        push_output(HubSettings(push_to_hub=True, hub_model_id="me/my-ppo"), out, "ppo")
    message = str(failed.value)
    assert message.startswith(f"the ppo output is complete in {out}, but pushing it to me/my-ppo failed (")
    assert "403" in message  # the hub's own refusal, after the repo was made with the token
    assert message.endswith(f"push it again with `hf upload me/my-ppo {out}`") and "\n" not in message
    assert (out / "adapter_model.safetensors").read_bytes() == b"weights"
    assert push_output(HubSettings(), out, "ppo") is None  # not asked: nothing pushed


@pytest.mark.parametrize(
    ("settings", "env", "message"),
    [
        ({"hub_model_id": None}, {}, "push_to_hub needs hub_model_id as owner/name (got None)"),
        ({"hub_model_id": "my-model"}, {}, "push_to_hub needs hub_model_id as owner/name (got 'my-model')"),
        ({}, {"HF_HUB_OFFLINE": "1"}, "push_to_hub needs the hub, but HF_HUB_OFFLINE is set"),
        ({}, {"HF_TOKEN": None}, "push_to_hub needs a hub token; run `hf auth login` or set HF_TOKEN"),
    ],
)
def test_a_push_that_cannot_work_is_refused_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: dict, env: dict, message: str
) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no token saved by a login
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))  # read when the hub was imported
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", "hf_standin")
    for key, value in env.items():
        if value is None:
            monkeypatch.delenv(key)
        else:
            monkeypatch.setenv(key, value)
    with pytest.raises(UsageError, match="^") as refused:
        HubSettings(**{"push_to_hub": True, "hub_model_id": "me/model", **settings}).validate()
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("stage", ["sft", "merge", "rm", "ppo", "dpo", "grpo"])
def test_every_stage_that_writes_a_model_takes_the_hub_settings(stage: str) -> None:
    from fitrl.stages import get

    with pytest.raises(UsageError, match="push_to_hub needs hub_model_id as owner/name"):
        get(stage).parse(["--config", str(CONFIGS / "demo" / f"{stage}.yaml"), "--push_to_hub", "true"])
