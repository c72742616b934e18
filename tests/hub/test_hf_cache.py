"""Embedded checkpoints in huggingface_hub's cache layout (python -m deqzoo.hub.hf_cache): huggingface_hub's
own cache scanner accepts what is written, the user's cache entries are never overwritten, and stock
transformers, timm (hf-hub:) and diffusers load every embedded hub id with the network blocked."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from deqzoo.hub.catalog import load_catalog
from deqzoo.hub.hf_cache import MARKER, main, populate_hf_cache

ROOT = Path(__file__).resolve().parents[2]


def test_layout_is_huggingface_hubs_and_files_match_the_catalog(tmp_path):
    from huggingface_hub import scan_cache_dir

    report = populate_hf_cache(tmp_path)
    catalog = load_catalog()
    assert set(report) == set(catalog) and all(s.startswith("written") for s in report.values())
    scanned = {repo.repo_id: repo for repo in scan_cache_dir(tmp_path).repos}  # huggingface_hub's own reader
    assert set(scanned) == set(catalog)
    for cid, entry in catalog.items():
        (revision,) = scanned[cid].revisions
        assert revision.refs == {"main"}
        files = {Path(f.file_path).relative_to(revision.snapshot_path).as_posix(): f.file_path
                 for f in revision.files}
        assert set(files) == set(entry["files"]), cid
        for rel, path in files.items():
            digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            if rel == "config.json" and "pretrained_cfg" in json.loads(Path(path).read_text()):
                config = json.loads(Path(path).read_text())  # timm keys added, the rest unchanged
                assert config["architecture"] == cid.split("/")[1].replace("-", "_")
                assert config["pretrained_cfg"]["hf_hub_id"] == cid
                continue
            assert digest == entry["files"][rel], (cid, rel)
    assert all(s.startswith("present") for s in populate_hf_cache(tmp_path).values())  # idempotent


def test_never_overwrites_a_users_cache_entry(tmp_path, capsys):
    user_repo = tmp_path / "models--deqzoo--mdeq-tiny-mnist"
    (user_repo / "refs").mkdir(parents=True)
    (user_repo / "refs" / "main").write_text("0" * 40)  # e.g. a real download of that id
    before = sorted((p.relative_to(tmp_path).as_posix(), p.read_bytes()) for p in user_repo.rglob("*")
                    if p.is_file())
    assert main(["--cache-dir", str(tmp_path), "deqzoo/mdeq-tiny-mnist", "deqzoo/ignn-chains"]) == 0
    out = capsys.readouterr().out
    assert "deqzoo/mdeq-tiny-mnist: kept" in out and "deqzoo/ignn-chains: written" in out
    after = sorted((p.relative_to(tmp_path).as_posix(), p.read_bytes()) for p in user_repo.rglob("*")
                   if p.is_file())
    assert after == before
    # deqzoo's own entry is refreshed when its ref no longer matches (the catalog changed)
    own = tmp_path / "models--deqzoo--ignn-chains"
    assert (own / MARKER).is_file()
    (own / "refs" / "main").write_text("f" * 40)
    assert populate_hf_cache(tmp_path, ["deqzoo/ignn-chains"])["deqzoo/ignn-chains"].startswith("written")


# Runs in a fresh interpreter whose sockets refuse to connect (and count the attempts): any request to the
# Hub would fail at once, and the test would see it in the count.
_BLOCKED = r'''
import socket, time, json, sys
attempts = []
def refuse(self, address, *a, **k):
    attempts.append(str(address))
    raise ConnectionRefusedError(f"network blocked by the test ({address})")
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
timings = {}
def timed(name, fn):
    start = time.perf_counter()
    obj = fn()
    timings[name] = [type(obj).__name__, round(time.perf_counter() - start, 3)]
import deqzoo, transformers, timm
deqzoo.register()
from diffusers import DiffusionPipeline
for hub_id, how in json.loads(sys.argv[1]).items():
    if how == "image":
        timed(hub_id + " AutoModelForImageClassification",
              lambda: transformers.AutoModelForImageClassification.from_pretrained(hub_id))
        timed(hub_id + " pipeline", lambda: transformers.pipeline("image-classification", model=hub_id))
        timed(hub_id + " timm hf-hub", lambda: timm.create_model("hf-hub:" + hub_id, pretrained=True))
    elif how == "text":
        causal_lm = transformers.AutoModelForCausalLM
        timed(hub_id + " AutoModelForCausalLM", lambda: causal_lm.from_pretrained(hub_id))
        timed(hub_id + " pipeline", lambda: transformers.pipeline("text-generation", model=hub_id))
    elif how == "diffusers":
        timed(hub_id + " DiffusionPipeline", lambda: DiffusionPipeline.from_pretrained(hub_id))
    else:
        timed(hub_id + " AutoModel", lambda: transformers.AutoModel.from_pretrained(hub_id))
print(json.dumps({"attempts": attempts, "timings": timings}))
'''


def test_stock_libraries_load_every_embedded_id_with_the_network_blocked(tmp_path):
    populate_hf_cache(tmp_path / "hub")
    kinds = {"mdeq": "image", "deq_transformer": "text", "DDIMPipeline": "diffusers"}
    plan = {cid: kinds.get(entry["model_type"], "auto") for cid, entry in load_catalog().items()}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "HF_ENDPOINT": "http://127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-c", _BLOCKED, json.dumps(plan)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["attempts"] == [], "no request may leave the machine"
    expected = {"mdeq-tiny-mnist AutoModelForImageClassification": "MDEQForImageClassification",
                "mdeq-tiny-mnist timm hf-hub": "MDEQTimm",
                "deq-transformer-tiny-pydoc AutoModelForCausalLM": "DEQTransformerForCausalLM",
                "ddim-digits-16 DiffusionPipeline": "DDIMPipeline"}
    got = {k.split("/", 1)[1]: v[0] for k, v in result["timings"].items()}
    for key, cls in expected.items():
        assert got[key] == cls, (key, got)
    assert len(got) == sum(3 if k == "image" else 2 if k == "text" else 1 for k in plan.values())
    # no retries: every load is fast (the first diffusers/pipeline call also pays its library's imports)
    slow = {k: v for k, v in result["timings"].items() if v[1] > 30}
    assert not slow, slow
    print(json.dumps(result["timings"], indent=1))
