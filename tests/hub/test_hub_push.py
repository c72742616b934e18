"""push_to_hub / `deqzoo push` end to end against a loopback server speaking the Hub endpoints the client
calls (create repo, create branch, validate-yaml, preupload, commit (to a branch or as a pull request),
revision info, tree, resolve with etag), then reload via from_pretrained with HF_ENDPOINT pointing at it.
The server records every request (method, path, query, headers, JSON body) so the tests can check that each
upload option reached the Hub."""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import pytest
import torch

import deqzoo
from deqzoo.cli import main as cli_main


class FakeHub:
    """In-memory repos: {repo_id: {path: bytes}} plus a commit sha per repo."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}  # the main branch
        self.branches: dict[tuple[str, str], dict[str, bytes]] = {}  # (repo_id, branch or refs/pr/N)
        self.sha: dict[str, str] = {}  # main's commit per repo
        self.ref_sha: dict[tuple[str, str], str] = {}  # every ref's commit
        self.calls: list[str] = []
        self.requests: list[dict] = []  # method, path, query, headers (lower-case keys), json body

    def files(self, repo_id: str, ref: str = "main") -> dict[str, bytes]:
        return self.repos[repo_id] if ref == "main" else self.branches[(repo_id, ref)]

    def commit(self, repo_id: str, files: dict[str, bytes], ref: str = "main") -> str:
        self.files(repo_id, ref).update(files)
        digest = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in
                                           self.files(repo_id, ref).items())).encode()).hexdigest()
        if ref == "main":
            self.sha[repo_id] = digest
        self.ref_sha[(repo_id, ref)] = digest
        return digest

    def commit_of(self, repo_id: str, ref: str) -> str | None:
        """The commit a branch name, refs/pr/N or sha points at."""
        for (repo, name), sha in self.ref_sha.items():
            if repo == repo_id and ref in (name, sha):
                return sha
        return None

    def lookup(self, repo_id: str, ref: str) -> dict[str, bytes]:
        """Files at a branch name, refs/pr/N or a commit sha ({} when unknown)."""
        for (repo, name), sha in self.ref_sha.items():
            if repo == repo_id and ref in (name, sha):
                return self.files(repo_id, name)
        return self.repos.get(repo_id, {}) if ref == "main" else self.branches.get((repo_id, ref), {})

    def find(self, method: str, pattern: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == method and re.fullmatch(pattern, r["path"])]


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

        def _record(self, method: str, body: bytes = b"") -> tuple[str, dict]:
            url = urlparse(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                parsed = json.loads(body) if body else None
            except ValueError:  # ndjson (commit payload)
                parsed = [json.loads(line) for line in body.splitlines() if line.strip()]
            hub.requests.append({"method": method, "path": url.path, "query": query, "json": parsed,
                                 "headers": {k.lower(): v for k, v in self.headers.items()}})
            hub.calls.append(f"{method} {url.path}")
            return url.path, query

        def do_POST(self):  # noqa: N802 - http.server naming
            body = self._body()
            path, query = self._record("POST", body)
            if path == "/api/repos/create":
                data = json.loads(body)
                org = data.get("organization")
                repo_id = f"{org}/{data['name']}" if org else data["name"]
                hub.repos.setdefault(repo_id, {})
                return self._json({"url": f"http://{self.headers['Host']}/{repo_id}", "name": repo_id})
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/branch/(.+)", path)
            if m:
                key = (m.group(1), unquote(m.group(2)))
                if key in hub.branches:
                    return self._json({"error": "Reference already exists"}, 409)
                hub.branches[key] = dict(hub.repos[m.group(1)])
                return self._json({})
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
                repo_id, ref = unquote(m.group(1)), unquote(m.group(2))
                files = {}
                for line in body.splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    elif item["key"] != "header":
                        return self._json({"error": f"unsupported op {item['key']}"}, 400)
                if ref != "main" and (repo_id, ref) not in hub.branches:
                    return self._json({"error": f"Invalid rev id: {ref}"}, 404)
                host = f"http://{self.headers['Host']}"
                pr_url = None
                if query.get("create_pr") == "1":  # a pull request: a new ref on top of the target
                    number = 1 + sum(1 for r, b in hub.branches if r == repo_id and b.startswith("refs/pr/"))
                    hub.branches[(repo_id, f"refs/pr/{number}")] = dict(hub.files(repo_id, ref))
                    ref, pr_url = f"refs/pr/{number}", f"{host}/{repo_id}/discussions/{number}"
                sha = hub.commit(repo_id, files, ref)
                return self._json({"commitUrl": f"{host}/{repo_id}/commit/{sha}", "commitOid": sha,
                                   "pullRequestUrl": pr_url})
            self._json({"error": f"no route {path}"}, 404)

        def _get(self, head: bool):
            path, _ = self._record("HEAD" if head else "GET")
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path)
            if m:
                repo_id, ref = m.group(1), unquote(m.group(2))
                if repo_id not in hub.repos:
                    return self._json({"error": "Repository not found"}, 404)
                sha = hub.commit_of(repo_id, ref) or ref
                return self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                                   "siblings": [{"rfilename": n} for n in sorted(hub.lookup(repo_id, ref))]})
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)/?(.*)", path)
            if m:
                files = hub.lookup(m.group(1), unquote(m.group(2)))
                return self._json([{"type": "file", "path": name, "size": len(data),
                                    "oid": hashlib.sha1(data).hexdigest()}
                                   for name, data in sorted(files.items())])
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                repo_id, ref, filename = m.group(1), unquote(m.group(2)), unquote(m.group(3))
                if repo_id not in hub.repos:
                    return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)
                content = hub.lookup(repo_id, ref).get(filename)
                if content is None:
                    return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                etag = hashlib.sha256(content).hexdigest()
                return self._send(200, content, {"ETag": f'"{etag}"',
                                                 "X-Repo-Commit": hub.commit_of(repo_id, ref),
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


# --- upload options: each one must reach the Hub's requests -------------------------------------------------
def _commit_request(hub: FakeHub) -> dict:
    (request,) = hub.find("POST", r"/api/models/.+/commit/.+")
    return request


def _committed_paths(request: dict) -> set[str]:
    return {item["value"]["path"] for item in request["json"] if item["key"] == "file"}


def _committed_file(request: dict, name: str) -> bytes:
    return next(base64.b64decode(item["value"]["content"]) for item in request["json"]
                if item["key"] == "file" and item["value"]["path"] == name)


def test_push_to_hub_options_reach_the_hub(fake_hub, toy_family, tmp_path):
    hub, _ = fake_hub
    toy = importlib.import_module("deqzoo_hub_toy_family")
    torch.manual_seed(4)
    model = toy.ToyDEQForImageClassification(toy.ToyDEQConfig(hidden_size=8))
    url = model.push_to_hub("carol/toy-options", commit_message="Retrained on digits",
                            commit_description="Longer training, same recipe.", private=True,
                            token="hf_explicit_token", revision="dev", tags=["mnist", "my-tag"])
    (create,) = hub.find("POST", r"/api/repos/create")
    assert create["json"]["visibility"] == "private"
    assert create["json"]["name"] == "toy-options" and create["json"]["organization"] == "carol"
    assert hub.find("POST", r"/api/models/carol/toy-options/branch/dev"), "revision: the branch is created"
    commit = _commit_request(hub)
    assert commit["path"] == "/api/models/carol/toy-options/commit/dev"
    assert commit["query"].get("create_pr") in (None, "0")
    header = commit["json"][0]
    assert header == {"key": "header", "value": {"summary": "Retrained on digits",
                                                 "description": "Longer training, same recipe."}}
    # token: every request of the push carries the explicit token, not $HF_TOKEN
    pushing = [r for r in hub.requests if r["method"] == "POST"]
    assert pushing and all(r["headers"].get("authorization") == "Bearer hf_explicit_token" for r in pushing)
    # tags: in the uploaded card's metadata
    card = _committed_file(commit, "README.md").decode()
    front = card.split("---")[1]
    assert "mnist" in front and "my-tag" in front and "library_name: deqzoo" in front
    # the commit landed on the branch, not on main
    assert hub.repos["carol/toy-options"] == {}
    assert {"config.json", "model.safetensors", "README.md"} <= set(hub.files("carol/toy-options", "dev"))
    assert str(url).startswith("http://127.0.0.1") and "/commit/" in str(url)
    loaded = toy.ToyDEQForImageClassification.from_pretrained("carol/toy-options", revision="dev",
                                                              cache_dir=tmp_path / "cache")
    _assert_same_weights(model, loaded)


def test_push_to_hub_create_pr_opens_a_pull_request(fake_hub, toy_family):
    hub, _ = fake_hub
    toy = importlib.import_module("deqzoo_hub_toy_family")
    model = toy.ToyDEQForImageClassification(toy.ToyDEQConfig(hidden_size=8))
    model.push_to_hub("dave/toy-pr")  # main has a first version
    main_before = dict(hub.repos["dave/toy-pr"])
    hub.requests.clear()
    with torch.no_grad():
        model.head.bias.add_(1.0)
    info = model.push_to_hub("dave/toy-pr", create_pr=True, commit_message="Proposed fix")
    commit = _commit_request(hub)
    assert commit["path"] == "/api/models/dave/toy-pr/commit/main" and commit["query"]["create_pr"] == "1"
    assert info.pr_url.endswith("/dave/toy-pr/discussions/1")
    assert hub.repos["dave/toy-pr"] == main_before, "create_pr must not commit to main"
    assert hub.files("dave/toy-pr", "refs/pr/1")["model.safetensors"] != main_before["model.safetensors"]


def test_save_pretrained_push_to_hub_forwards_options(fake_hub, toy_family, tmp_path):
    hub, _ = fake_hub
    toy = importlib.import_module("deqzoo_hub_toy_family")
    model = toy.ToyDEQForImageClassification(toy.ToyDEQConfig(hidden_size=8))
    model.save_pretrained(tmp_path / "erin-toy", push_to_hub=True, repo_id="erin/toy",
                          commit_message="From save_pretrained", revision="exp")
    commit = _commit_request(hub)
    assert commit["path"] == "/api/models/erin/toy/commit/exp"
    assert commit["json"][0]["value"]["summary"] == "From save_pretrained"


def test_cli_push_options_and_stray_files(fake_hub, toy_checkpoint, tmp_path, capsys):
    hub, _ = fake_hub
    directory, _ = toy_checkpoint
    needed = {p.name for p in directory.iterdir()}
    card_before = (directory / "README.md").read_bytes()
    # what a training run leaves beside a checkpoint: none of it belongs in the repository
    (directory / "optimizer.pt").write_bytes(b"pickled optimizer state")
    (directory / "train.log").write_text("step 1 loss 2.3\n")
    (directory / ".env").write_text("SECRET=1\n")
    (directory / "checkpoint-500").mkdir()
    (directory / "checkpoint-500" / "model.safetensors").write_bytes(b"x")
    (directory / "__pycache__").mkdir()
    (directory / "__pycache__" / "x.pyc").write_bytes(b"x")
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (directory / "linked.json").symlink_to(outside)
    argv = ["push", str(directory), "--repo-id", "frank/toy-cli", "-m", "CLI message", "--commit-description",
            "CLI description", "--revision", "v2", "--create-pr", "--tag", "a-tag", "--tag", "b-tag",
            "--private", "--token", "hf_cli_token"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "not uploading 6 file(s)" in out and "optimizer.pt" in out and "pull request" in out
    (create,) = hub.find("POST", r"/api/repos/create")
    assert create["json"]["visibility"] == "private"
    assert hub.find("POST", r"/api/models/frank/toy-cli/branch/v2")
    commit = _commit_request(hub)
    assert commit["path"] == "/api/models/frank/toy-cli/commit/v2" and commit["query"]["create_pr"] == "1"
    assert commit["json"][0]["value"] == {"summary": "CLI message", "description": "CLI description"}
    assert commit["headers"]["authorization"] == "Bearer hf_cli_token"
    assert _committed_paths(commit) == needed, "exactly the checkpoint's files, no stray ones"
    preupload = hub.find("POST", r"/api/models/.+/preupload/.+")
    assert {f["path"] for r in preupload for f in r["json"]["files"]} == needed
    card = _committed_file(commit, "README.md").decode()
    assert "a-tag" in card and "b-tag" in card and "deqzoo_task" in card, "tags merged into the folder's card"
    assert (directory / "README.md").read_bytes() == card_before, "the user's card file is not modified"


def test_push_refuses_a_folder_without_config(fake_hub, tmp_path):
    hub, _ = fake_hub
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert cli_main(["push", str(tmp_path), "--repo-id", "gina/none"]) == 2
    assert hub.calls == []


def test_every_embedded_checkpoint_would_upload_complete():
    """The upload selection keeps every file of each embedded repository (cards, images they show, a
    diffusers repository's components, an evaluator folder the card names) and finds nothing stray."""
    from deqzoo.hub.catalog import embedded_folder, load_catalog
    from deqzoo.hub.push import checkpoint_upload_files

    for cid, entry in load_catalog().items():
        upload, stray = checkpoint_upload_files(embedded_folder(entry))
        assert upload == sorted(entry["files"]) and stray == [], cid


# --- hypersolvers: huggingface_hub's PyTorchModelHubMixin, with deqzoo's checks -----------------------------
def test_hypersolver_push_to_hub_and_from_pretrained(fake_hub, tmp_path, monkeypatch):
    """A hypersolver is pushed with the mixin's push_to_hub, loaded back by repo id with its sha256 and shapes
    checked, and still refuses a model it was not trained for."""
    import functools

    from huggingface_hub import HfApi, hub_mixin

    from deqzoo.hypersolver import HyperSolver, HyperSolverError, model_fingerprint
    from examples.hypersolver._problems import default_config

    hub, endpoint = fake_hub
    # the mixin's HfApi() takes $HF_ENDPOINT as read at import time; the fixture sets it later
    monkeypatch.setattr(hub_mixin, "HfApi", functools.partial(HfApi, endpoint=endpoint))
    model = deqzoo.create_model("mdeq-tiny-mnist")
    hs = HyperSolver(default_config(model, "me/mdeq"))
    for p in hs.parameters():
        p.data.normal_()
    hs.push_to_hub("me/hs-push", commit_message="Trained hypersolver")
    assert {"config.json", "model.safetensors", "README.md"} <= set(hub.repos["me/hs-push"])
    assert "library_name: deqzoo" in hub.repos["me/hs-push"]["README.md"].decode()
    assert json.loads(hub.repos["me/hs-push"]["config.json"])["training"]["weights_sha256"] == hashlib.sha256(
        hub.repos["me/hs-push"]["model.safetensors"]).hexdigest()
    back = HyperSolver.from_pretrained("me/hs-push", cache_dir=tmp_path / "cache")
    _assert_same_weights(hs, back)
    assert back.config.model_fingerprint == model_fingerprint(model)
    model.set_hypersolver(back)  # trained for this model
    other = deqzoo.create_model("mdeq-tiny-mnist")  # same architecture, other weights
    with pytest.raises(HyperSolverError, match="does not fit model"):
        other.set_hypersolver(back)


def test_hypersolver_repo_with_only_a_pickle_is_refused_unread(fake_hub, tmp_path, monkeypatch):
    """The mixin falls back to pytorch_model.bin (torch.load) when a repo has no model.safetensors; deqzoo's
    from_pretrained never reaches that fallback: the pickle is neither downloaded nor opened."""
    from deqzoo.hypersolver import HyperSolver, HyperSolverConfig, HyperSolverError

    hub, _ = fake_hub
    config = HyperSolverConfig(state_kind="vector", state_channels=[8], pool=4)
    hub.repos["me/hs-pickle"] = {}
    files = {"config.json": json.dumps(config.to_dict()).encode(), "pytorch_model.bin": b"PK pickle"}
    hub.commit("me/hs-pickle", files)
    with pytest.raises(HyperSolverError, match="model.safetensors"):
        HyperSolver.from_pretrained("me/hs-pickle", cache_dir=tmp_path / "cache")
    assert not any("pytorch_model.bin" in c for c in hub.calls)


def test_hypersolver_weights_link_leading_out_is_refused(tmp_path):
    from deqzoo.hypersolver import HyperSolver, HyperSolverConfig, HyperSolverError, save_hypersolver

    hs = HyperSolver(HyperSolverConfig(state_kind="vector", state_channels=[8], pool=4))
    save_hypersolver(hs, tmp_path / "outside")
    save_hypersolver(hs, tmp_path / "hs")
    (tmp_path / "hs" / "model.safetensors").unlink()
    (tmp_path / "hs" / "model.safetensors").symlink_to(tmp_path / "outside" / "model.safetensors")
    with pytest.raises(HyperSolverError, match="link leading outside"):
        HyperSolver.from_pretrained(tmp_path / "hs")


SECRET_LOOKING = ("credentials.json", "secret_token.json", "notes.txt")


def test_push_leaves_secret_looking_files_out_and_says_so(fake_hub, toy_checkpoint, capsys, caplog):
    """Issue 57: every top-level *.json counted as a config, so credentials.json and secret_token.json were
    committed without notice. Both `push_folder` and `deqzoo push` leave them out and name them."""
    from deqzoo.hub.push import push_folder

    hub, _ = fake_hub
    directory, _ = toy_checkpoint
    needed = {p.name for p in directory.iterdir()}
    for name in SECRET_LOOKING:
        (directory / name).write_text('{"token": "hf_secret"}')
    with caplog.at_level("WARNING", logger="deqzoo"):
        push_folder(directory, repo_id="henry/toy-secrets")
    assert set(hub.repos["henry/toy-secrets"]) == needed
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in warned for name in SECRET_LOOKING) and "not uploading 3 file(s)" in warned

    assert cli_main(["push", str(directory), "--repo-id", "henry/toy-secrets-cli"]) == 0
    out = capsys.readouterr().out
    assert "not uploading 3 file(s)" in out and all(name in out for name in SECRET_LOOKING)
    assert set(hub.repos["henry/toy-secrets-cli"]) == needed
    assert not any(b"hf_secret" in data for repo in hub.repos.values() for data in repo.values())
