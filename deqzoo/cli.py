"""The `deqzoo` command: list, info, predict, push (the installed package's), and eval, demo, bench, app,
convert, train-hypersolver (programs of the repository, run from a clone).

The clone is found from the package's own location (an editable install: `deqzoo/` inside a clone holding
`examples/tasks.py`), never from the working directory; a wheel's install says how to get a clone.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from deqzoo.errors import DeqzooError


class CLIError(DeqzooError):
    """An expected failure of a command: printed as one line, exit code 2."""


def format_table(rows: list[list[str]], header: list[str]) -> str:
    """Columns two spaces apart, a dashed rule under the header."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)


def _fmt_params(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def _fmt_metrics(metrics: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())


def load_checkpoint(name: str, deq: dict[str, Any] | None = None):
    """(model, directory, card metadata, card metrics) of a checkpoint, loaded without a progress bar."""
    from transformers.utils import logging as hf_logging

    import deqzoo
    from deqzoo.factory import checkpoint_card

    directory, meta, metrics = checkpoint_card(name)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar: a command prints its own output
    try:
        model = deqzoo.from_pretrained(directory, deq=deq)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return model, directory, meta, metrics


def cmd_list(args) -> int:
    import deqzoo
    from deqzoo.hub.catalog import load_catalog
    from deqzoo.models.registry import unavailable_families

    models = deqzoo.list_models(args.kind)
    if args.json:
        print(json.dumps([vars(m) for m in models], indent=2))
        return 0
    headlines = {cid: entry.get("headline") for cid, entry in load_catalog().items()}
    rows = [[m.name, m.kind, m.model_type or "?", m.task or "?", _fmt_params(m.parameters),
             (headlines.get(m.name) or _fmt_metrics(m.metrics)) if m.kind == "checkpoint" else m.description]
            for m in models]
    header = ["name", "kind", "model_type", "task", "params", "headline result (data set) / description"]
    print(format_table(rows, header) if rows else "no models registered")
    for model_type, reason in unavailable_families().items():
        print(f"(family {model_type} unavailable: {reason})")
    return 0


def cmd_info(args) -> int:
    from deqzoo.factory import _find_preset, checkpoint_card
    from deqzoo.hub.loading import embedded_entry
    from deqzoo.hub.validation import confined, read_json

    family, preset = _find_preset(args.name)
    if preset is not None:
        print(json.dumps({"architecture": args.name, "model_type": family.model_type, **preset}, indent=2,
                         default=str))
        return 0
    directory, meta, metrics = checkpoint_card(args.name)
    config = read_json(confined(directory, "config.json", directory))
    entry = embedded_entry(args.name) or {}
    info = {"id": entry.get("id", args.name), "directory": str(directory),
            "model_type": config.get("model_type"),
            "architectures": config.get("architectures"), "task": meta.get("pipeline_tag"),
            "deqzoo_task": meta.get("deqzoo_task"), "metrics": metrics, "parameters": entry.get("parameters"),
            "datasets": meta.get("datasets"), "license": meta.get("license"), "deq": config.get("deq"),
            "files": entry.get("files") or sorted(p.name for p in directory.iterdir())}
    print(json.dumps(info, indent=2, default=str))
    return 0


def cmd_predict(args) -> int:
    from deqzoo.predict import predict

    model, directory, meta, _ = load_checkpoint(args.name)
    if not meta.get("deqzoo_task"):
        raise CLIError(f"{directory / 'README.md'}: the model card has no `deqzoo_task` key naming the task")
    try:
        print(predict(model, meta["deqzoo_task"], args.input))
    except ValueError as err:
        if "registered task" in str(err):
            raise CLIError(f"{directory / 'README.md'}: {err}") from None
        raise
    return 0


def _positive_int(text: str) -> int:
    """argparse type for counts: a clear usage error for 0, negatives and non-integers (not a crash later)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def cmd_eval(args) -> int:
    demo = _clone_program("examples/demo.py", "examples.demo", _from_a_clone("eval", "[demo]"))
    names = list(dict.fromkeys(args.name))  # a name given twice is evaluated once
    # every name is loaded (and checked) before any evaluation: a typo in the second of a pair fails at once
    loaded = [load_checkpoint(name) for name in names]
    for name, (model, directory, meta, _) in zip(names, loaded):
        task = demo.task_of(directory, meta)
        results = task.evaluate(model, limit=args.limit, progress=not args.no_progress)
        if len(loaded) > 1:  # several: each one's results under its name (a card and its twin side by side)
            print(name)
        for key, value in results.items():
            print(f"{'  ' if len(loaded) > 1 else ''}{key}: {value:.4f}")
    return 0


def cmd_convert(rest: list[str]) -> int:
    """`deqzoo convert ARGS`: the clone's converters (conversion/)."""
    conversion = _clone_program("conversion/__init__.py", "conversion", _from_a_clone("convert", ""))
    return int(conversion.main(rest) or 0)


def cmd_push(args) -> int:
    from deqzoo.hub.push import checkpoint_upload_files, push_folder

    _, stray = checkpoint_upload_files(args.directory) if Path(args.directory).is_dir() else ([], [])
    if stray:
        print(f"not uploading {len(stray)} file(s) a checkpoint does not need: {', '.join(stray[:10])}"
              + (" ..." if len(stray) > 10 else ""))
    info = push_folder(args.directory, repo_id=args.repo_id, private=args.private or None, token=args.token,
                       endpoint=args.endpoint, commit_message=args.commit_message,
                       commit_description=args.commit_description, revision=args.revision,
                       create_pr=args.create_pr, tags=args.tag)
    pr_url = getattr(info, "pr_url", None)
    where = f"pull request {pr_url}" if pr_url else str(info)
    print(f"pushed {args.directory} to {args.repo_id}: {where}")
    return 0


def _clone_root() -> Path | None:
    """The clone this package runs from (the folder above `deqzoo/` when it holds the repository's programs),
    None for an installed wheel."""
    import deqzoo

    root = Path(deqzoo.__file__).resolve().parent.parent
    is_clone = (root / "examples" / "tasks.py").is_file() and (root / "pyproject.toml").is_file()
    return root if is_clone else None


def _from_a_clone(command: str, extra: str) -> str:
    return (f"`deqzoo {command}` runs a program of the deqzoo repository; this command is not in the wheel. "
            f"Run it from a clone: git clone <the deqzoo repository> && cd deqzoo && "
            f"pip install -e \".{extra}\" && deqzoo {command} ...")


def _import_from_clone(root: Path | None, module: str):
    """A module of the clone at `root` (benchmarks, examples, the app): repository code, not installed."""
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(module)


def _clone_program(marker: str, module: str, refusal: str):
    """`module` of the clone, which must hold the file `marker`; else CLIError(refusal)."""
    root = _clone_root()
    if root is None or not (root / marker).is_file():
        raise CLIError(refusal)
    return _import_from_clone(root, module)


def benchmark_names() -> list[str]:
    """The benchmarks `deqzoo bench NAME` runs: the modules of the clone's `benchmarks/` (not imported)."""
    root = _clone_root()
    files = (root / "benchmarks").glob("*.py") if root else ()
    return sorted(p.stem for p in files if not p.name.startswith("_"))


def cmd_bench(args, rest: list[str]) -> int:
    args.name = args.name.replace("-", "_")  # `deqzoo bench deq-ddim` runs benchmarks/deq_ddim.py
    known, root = benchmark_names(), _clone_root()
    # the clone's own benchmark modules (or one trusted code already imported): the argument never names
    # other code
    if args.name not in known and f"benchmarks.{args.name}" not in sys.modules:
        raise CLIError(f"unknown benchmark {args.name!r}; known benchmarks: {known}" if root else
                       f"unknown benchmark {args.name!r}: " + _from_a_clone("bench", "[bench]"))
    return int(_import_from_clone(root, f"benchmarks.{args.name}").main(rest) or 0)


def cmd_train_hypersolver(rest: list[str]) -> int:
    """`deqzoo train-hypersolver ARGS`: the clone's examples/hypersolver/train.py."""
    train = _clone_program("examples/hypersolver/train.py", "examples.hypersolver.train",
                           _from_a_clone("train-hypersolver", ""))
    return int(train.main(rest, prog="deqzoo train-hypersolver") or 0)


def cmd_demo(args) -> int:
    demo = _clone_program("examples/demo.py", "examples.demo", _from_a_clone("demo", "[demo]"))
    return demo.main(args.names, args.output_dir, progress=not args.no_progress)


def cmd_app(args) -> int:
    """`deqzoo app`: the clone's Gradio app (deqzoo_app/, beside the Space entry point app.py)."""
    app = _clone_program("deqzoo_app/__init__.py", "deqzoo_app",
                         "the app ships with the deqzoo repository (deqzoo_app/ and app.py), not with the "
                         "installed package; run it from the root of a clone: git clone ... && cd deqzoo && "
                         "pip install -e \".[app]\" && deqzoo app (or python app.py)")
    if importlib.util.find_spec("gradio") is None:
        raise CLIError(app.gradio_missing_message())
    app.launch(port=args.port, warm_up=not args.no_warm_up)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from deqzoo import __version__

    parser = argparse.ArgumentParser(prog="deqzoo", description="Deep equilibrium model zoo and hub.")
    parser.add_argument("--version", action="version", version=f"deqzoo {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (also DEQZOO_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="architectures and checkpoints")
    p.add_argument("--kind", choices=["architecture", "checkpoint"])
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("info", help="details of an architecture or checkpoint")
    p.add_argument("name")
    p = sub.add_parser("predict", help="run a checkpoint on an input (path or text)")
    p.add_argument("name", help="checkpoint id (deqzoo list) or folder")
    p.add_argument("input", nargs="+", help="by the checkpoint's task: an image path (classification); a "
                   "text or text file (language); a chain length or JSON graph (graphs); FIRST SECOND "
                   "[OUT.png] images or a FOLDER [OUTDIR] of video frames (optical flow); HxW[:OUT.png] "
                   "(implicit representations); OUT.png (diffusion). Details: deqzoo.predict's docstrings")
    p = sub.add_parser("eval", help="evaluate a checkpoint with its card's task (from a clone: examples/)")
    p.add_argument("name", nargs="+", help="a checkpoint, or several: each one's results under its name")
    p.add_argument("--limit", type=_positive_int, default=None, help="evaluate on the first N examples")
    p.add_argument("--no-progress", action="store_true")
    sub.add_parser("convert", help="convert an original release (FORMAT SRC OUT; `convert list` lists; "
                   "from a clone: conversion/; `convert --help` lists its options)", add_help=False)
    p = sub.add_parser("push", help="upload a checkpoint directory through huggingface_hub")
    p.add_argument("directory")
    p.add_argument("--repo-id", required=True)
    p.add_argument("--commit-message", "-m", default=None, help='default: "Upload deqzoo model"')
    p.add_argument("--commit-description", default=None)
    p.add_argument("--revision", default=None, help="branch to commit to (created if missing)")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing")
    p.add_argument("--tag", action="append", default=None, metavar="TAG",
                   help="add a tag to the uploaded card's metadata (repeatable)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p.add_argument("--token", default=None, help="default: $HF_TOKEN or the stored login")
    p.add_argument("--endpoint", default=None, help="defaults to $HF_ENDPOINT or huggingface.co")
    p = sub.add_parser("bench", help="run a clone's benchmarks/NAME.py (remaining arguments go to it)",
                       epilog="available benchmarks: " + (", ".join(benchmark_names()) or "none here (run "
                                                          "from the root of a clone)")
                       + ". `deqzoo bench NAME --help` shows a benchmark's own options.")
    p.add_argument("name", help="one of: " + (", ".join(benchmark_names()) or "(none here)"))
    p = sub.add_parser("demo", help="run every embedded checkpoint offline and plot residuals per solver "
                       "(from a clone: examples/demo.py)")
    p.add_argument("names", nargs="*", help="checkpoints (default: all embedded)")
    p.add_argument("--output-dir", default="demo_output")
    p.add_argument("--no-progress", action="store_true")
    p = sub.add_parser("app", help="the Gradio app: a tab per family on 127.0.0.1 (from a clone, with the "
                       "`app` extra)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--no-warm-up", action="store_true", help="start at once; the first click loads models")
    sub.add_parser("train-hypersolver", help="train a HyperDEQ hypersolver for a frozen checkpoint (from "
                   "a clone: examples/hypersolver/train.py; `train-hypersolver --help` lists its options)",
                   add_help=False)
    return parser


def _one_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Failures a user can cause and fix (bad file, bad value, no network): one line, exit 2."""
    errors: list[type[BaseException]] = [DeqzooError, ValueError, OSError, KeyError, RuntimeError,
                                         RecursionError, MemoryError, UnicodeError]
    try:
        from PIL import Image

        errors += [Image.DecompressionBombError]
    except ImportError:
        pass
    return tuple(errors)


def main(argv: list[str] | None = None) -> int:
    """Run a `deqzoo` command; expected failures print one line naming what is at fault and return 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("DEQZOO_DEBUG", "").strip() not in ("", "0")
    while argv[:1] == ["--debug"]:
        argv, debug = argv[1:], True
    # `bench NAME`, `convert` and `train-hypersolver` pass every later argument on
    if argv[:1] not in (["bench"], ["convert"], ["train-hypersolver"]) and "--debug" in argv:
        argv, debug = [a for a in argv if a != "--debug"], True
    parser = build_parser()
    if argv[:1] == ["bench"] and len(argv) >= 2 and not argv[1].startswith("-"):
        args, rest = parser.parse_known_args(argv[:2])
        command, handler = "bench", (lambda a: cmd_bench(a, argv[2:]))
    elif argv[:1] == ["train-hypersolver"]:  # every argument is the training program's
        args, command, handler = None, "train-hypersolver", (lambda a: cmd_train_hypersolver(argv[1:]))
    elif argv[:1] == ["convert"]:  # every argument is the converters'
        args, command, handler = None, "convert", (lambda a: cmd_convert(argv[1:]))
    else:
        args = parser.parse_args(argv)
        command = args.command
        handlers = {"list": cmd_list, "info": cmd_info, "predict": cmd_predict, "eval": cmd_eval,
                    "push": cmd_push, "demo": cmd_demo, "app": cmd_app}
        handler = handlers[command]
    if command in ("demo", "app"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo never touches the network
    try:
        return handler(args)
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"deqzoo {command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as err:  # an optional dependency: name the extra that installs it
        from deqzoo.models.registry import missing_extra_message

        message = missing_extra_message(err)
        if debug or message is None:
            raise
        print(f"deqzoo {command}: error: {message} (run with --debug for the traceback)", file=sys.stderr)
        return 2
    except Exception as err:
        from deqzoo.hub.validation import is_network_error

        if debug or not (isinstance(err, _expected_errors()) or is_network_error(err)):
            raise
        print(f"deqzoo {command}: error: {_one_line(err)} (run with --debug for the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
