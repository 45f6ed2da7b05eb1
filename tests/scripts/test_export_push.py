"""The Hub push path, run with huggingface_hub's real client code (httpx, create_repo, upload_folder's
preupload + commit protocol) against a local HTTP server that implements the three Hub endpoints an upload of
small files uses. No network: HF_ENDPOINT (subprocess) / constants.ENDPOINT (in process) point at it."""

import base64
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from headway.heads.base import build_head, save_head
from headway.heads.formats import ExportError
from headway.heads.formats.hub import push_folder
from headway.heads.target import load_target

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_headwayTestToken0123456789abcdef"


class FakeHub(BaseHTTPRequestHandler):
    """POST /api/repos/create, /api/validate-yaml (the README's metadata), /api/models/{repo}/preupload/{rev},
    /api/models/{repo}/commit/{rev}; GET /api/agent-harnesses (the client's best-effort telemetry registry)."""

    hub: dict  # set per server: {"requests": [...], "files": {path: bytes}, "status": int}

    def log_message(self, *args):  # keep test output quiet
        pass

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.hub["requests"].append((self.path, self.headers.get("authorization"), b""))
        if self.path == "/api/agent-harnesses":
            return self.reply(200, {"standardEnvVars": [], "harnesses": {}})
        return self.reply(404, {"error": f"not implemented: {self.path}"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.hub["requests"].append((self.path, self.headers.get("authorization"), body))
        if self.hub["status"] != 200:
            return self.reply(self.hub["status"], {"error": "Invalid credentials in Authorization header"})
        endpoint = f"http://{self.headers['host']}"
        if self.path == "/api/repos/create":
            req = json.loads(body)
            return self.reply(200, {"url": f"{endpoint}/{req['organization']}/{req['name']}"})
        if self.path == "/api/validate-yaml":
            return self.reply(200, {"errors": [], "warnings": []})
        if "/preupload/" in self.path:
            files = json.loads(body)["files"]
            return self.reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                              for f in files]})
        if "/commit/" in self.path:
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.hub["files"][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            repo = self.path.split("/api/models/")[1].split("/commit/")[0]
            return self.reply(200, {"commitUrl": f"{endpoint}/{repo}/commit/{'a' * 40}", "commitOid": "a" * 40})
        return self.reply(404, {"error": f"not implemented: {self.path}"})


@pytest.fixture
def hub():
    state = {"requests": [], "files": {}, "status": 200}
    handler = type("Handler", (FakeHub,), {"hub": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["endpoint"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def local_hub(hub, monkeypatch, tmp_path):
    """In-process client pointed at the fake Hub, with HF_TOKEN set and no token file."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub["endpoint"])
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    return hub


@pytest.fixture(scope="module")
def final(tmp_path_factory):
    target = load_target({"path": "tiny-random", "name": "tiny-random"})
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("run") / "final"
    save_head(build_head("medusa", target, num_heads=2), folder)
    return folder


def test_push_uploads_every_file_with_the_token_in_memory_only(final, hub, tmp_path):
    out, home = tmp_path / "export", tmp_path / "hf_home"
    env = {**os.environ, "HF_ENDPOINT": hub["endpoint"], "HF_TOKEN": TOKEN, "HF_HOME": str(home),
           "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "export.py"), f"checkpoint={final}",
                          f"output={out}", "push=true", "repo_id=my-org/tiny-medusa", "private=true"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    posts = {p.split("?")[0]: body for p, _, body in hub["requests"] if body}
    assert json.loads(posts["/api/repos/create"]) == {"name": "tiny-medusa", "organization": "my-org",
                                                      "visibility": "private", "type": "model"}
    assert json.loads(posts["/api/validate-yaml"])["content"] == (out / "README.md").read_text()
    paths = list(posts)
    assert any(p.startswith("/api/models/my-org/tiny-medusa/preupload/main") for p in paths)
    assert any(p.startswith("/api/models/my-org/tiny-medusa/commit/main") for p in paths)
    assert all(auth == f"Bearer {TOKEN}" for p, auth, _ in hub["requests"] if p != "/api/agent-harnesses")
    local = {p.name: p.read_bytes() for p in out.iterdir()}
    assert hub["files"] == local and set(local) == {"README.md", "config.json", "headway.json", "model.safetensors"}
    assert b'"model": "my-org/tiny-medusa"' in local["README.md"]  # the card serves the pushed repo
    # the token reaches the Hub only in the Authorization header: never on disk, never in the output
    written = [p for p in [*out.rglob("*"), *home.rglob("*")] if p.is_file()]
    assert not any(TOKEN.encode() in p.read_bytes() for p in written)
    assert TOKEN not in res.stdout + res.stderr


def test_push_folder_in_process_and_http_errors(final, local_hub, tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    url = push_folder(folder, "my-org/again", private=False)
    assert url.endswith("/my-org/again") and local_hub["files"] == {"config.json": b"{}"}
    create = next(body for p, _, body in local_hub["requests"] if p == "/api/repos/create")
    assert json.loads(create)["visibility"] == "public"
    local_hub["status"] = 401
    with pytest.raises(ExportError, match=r"pushing to my-org/again failed \(HTTP 401: the token is invalid"):
        push_folder(folder, "my-org/again")


@pytest.mark.parametrize("repo_id", [None, "no-namespace", "a/b/c", "my org/x", "org/na..me", "org/-x-"])
def test_invalid_repo_id_is_refused_before_any_request(repo_id, local_hub, tmp_path):
    with pytest.raises(ExportError, match="repo_id=.* (is not of the form ORG/NAME|is not a valid Hub repo id)"):
        push_folder(tmp_path, repo_id)
    assert [p for p, _, _ in local_hub["requests"] if p != "/api/agent-harnesses"] == []


def test_no_token_is_a_clear_error_and_nothing_is_written(final, local_hub, tmp_path, monkeypatch, capsys):
    from test_export import compose, export_script

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    code = export_script().run(compose(f"checkpoint={final}", f"output={tmp_path / 'out'}", "push=true",
                                       "repo_id=my-org/x"))
    assert code == 2
    assert capsys.readouterr().err.strip() == ("export error: no Hugging Face token: set HF_TOKEN or run "
                                               "`hf auth login`, then push again")
    assert not (tmp_path / "out").exists()
    assert [p for p, _, _ in local_hub["requests"] if p != "/api/agent-harnesses"] == []
