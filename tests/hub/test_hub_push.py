"""push_to_hub / `deqzoo push` end to end against a loopback server speaking the Hub endpoints the client
calls (create repo, validate-yaml, preupload, commit, revision info, tree, resolve with etag), then reload via
from_pretrained with HF_ENDPOINT pointing at it."""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import pytest
import torch

import deqzoo
from deqzoo.cli import main as cli_main


class FakeHub:
    """In-memory repos: {repo_id: {path: bytes}} plus a commit sha per repo."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.sha: dict[str, str] = {}
        self.calls: list[str] = []

    def commit(self, repo_id: str, files: dict[str, bytes]) -> str:
        self.repos[repo_id].update(files)
        digest = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in
                                           self.repos[repo_id].items())).encode()).hexdigest()
        self.sha[repo_id] = digest
        return digest


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, obj, status: int = 200):
            self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_POST(self):  # noqa: N802 - http.server naming
            path = urlparse(self.path).path
            hub.calls.append(f"POST {path}")
            body = self._body()
            if path == "/api/repos/create":
                data = json.loads(body)
                org = data.get("organization")
                repo_id = f"{org}/{data['name']}" if org else data["name"]
                hub.repos.setdefault(repo_id, {})
                return self._json({"url": f"http://{self.headers['Host']}/{repo_id}", "name": repo_id})
            if path == "/api/validate-yaml":
                return self._json({"errors": [], "warnings": []})
            m = re.fullmatch(r"/api/models/(.+)/preupload/(.+)", path)
            if m:
                files = json.loads(body)["files"]
                # "regular": contents travel inline in the commit (no LFS / xet storage to emulate)
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return self._json({"files": modes})
            m = re.fullmatch(r"/api/models/(.+)/commit/(.+)", path)
            if m:
                repo_id = unquote(m.group(1))
                files = {}
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    elif item["key"] != "header":
                        return self._json({"error": f"unsupported op {item['key']}"}, 400)
                sha = hub.commit(repo_id, files)
                host = f"http://{self.headers['Host']}"
                return self._json({"commitUrl": f"{host}/{repo_id}/commit/{sha}", "commitOid": sha,
                                   "pullRequestUrl": None})
            self._json({"error": f"no route {path}"}, 404)

        def _get(self, head: bool):
            path = urlparse(self.path).path
            hub.calls.append(f"{'HEAD' if head else 'GET'} {path}")
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path)
            if m:
                repo_id = m.group(1)
                if repo_id not in hub.repos:
                    return self._json({"error": "Repository not found"}, 404)
                return self._json({"id": repo_id, "modelId": repo_id, "sha": hub.sha[repo_id],
                                   "private": False,
                                   "siblings": [{"rfilename": name} for name in sorted(hub.repos[repo_id])]})
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)/?(.*)", path)
            if m:
                files = hub.repos.get(m.group(1), {})
                return self._json([{"type": "file", "path": name, "size": len(data),
                                    "oid": hashlib.sha1(data).hexdigest()}
                                   for name, data in sorted(files.items())])
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                repo_id, _, filename = m.group(1), m.group(2), unquote(m.group(3))
                content = hub.repos.get(repo_id, {}).get(filename)
                if content is None:
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                etag = hashlib.sha256(content).hexdigest()
                return self._send(200, content, {"ETag": f'"{etag}"', "X-Repo-Commit": hub.sha[repo_id],
                                                 "Content-Type": "application/octet-stream"}, head)
            self._json({"error": f"no route {path}"}, 404)

        def do_GET(self):  # noqa: N802
            self._get(head=False)

        def do_HEAD(self):  # noqa: N802
            self._get(head=True)

    return Handler


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub.constants as hf_constants

    hub = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_TOKEN", "hf_loopback_test_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    yield hub, endpoint
    server.shutdown()
    server.server_close()


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_cli_push_then_from_pretrained_via_endpoint(fake_hub, toy_checkpoint, tmp_path, monkeypatch):
    hub, _ = fake_hub
    directory, model = toy_checkpoint
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # empty cache: the reload must download
    assert cli_main(["push", str(directory), "--repo-id", "alice/toy-deq"]) == 0
    assert set(hub.repos["alice/toy-deq"]) == {p.name for p in directory.iterdir()}
    assert hub.repos["alice/toy-deq"]["model.safetensors"] == (directory / "model.safetensors").read_bytes()

    loaded = deqzoo.from_pretrained("alice/toy-deq", cache_dir=tmp_path / "cache")
    _assert_same_weights(model, loaded)
    assert any(c.startswith("GET /alice/toy-deq/resolve/") for c in hub.calls)
    x = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(model(x).logits, loaded(x).logits)

    # Second load comes from the HF cache even with the server gone quiet (offline mode).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n_calls = len(hub.calls)
    again = deqzoo.from_pretrained("alice/toy-deq", cache_dir=tmp_path / "cache")
    _assert_same_weights(model, again)
    assert len(hub.calls) == n_calls


def test_model_push_to_hub_roundtrip(fake_hub, toy_family, tmp_path):
    hub, endpoint = fake_hub
    toy = importlib.import_module("deqzoo_hub_toy_family")  # registered by tests/hub/conftest.py
    torch.manual_seed(3)
    model = toy.ToyDEQForImageClassification(toy.ToyDEQConfig(hidden_size=8))
    url = model.push_to_hub("bob/toy-push")
    assert hub.sha["bob/toy-push"] in url
    assert {"config.json", "model.safetensors"} <= set(hub.repos["bob/toy-push"])
    loaded = toy.ToyDEQForImageClassification.from_pretrained("bob/toy-push", cache_dir=tmp_path / "cache",
                                                              deq={"f_solver": "fixed_point"})
    _assert_same_weights(model, loaded)
    assert loaded.deq.config.f_solver == "fixed_point"


def test_push_refuses_pickle_only_folder(fake_hub, tmp_path):
    hub, _ = fake_hub
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really")
    assert cli_main(["push", str(tmp_path), "--repo-id", "eve/pickles"]) == 2
    assert hub.calls == []
