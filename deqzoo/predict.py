"""`deqzoo predict`: a checkpoint on a user's input, one function per task kind (a card's ``deqzoo_task``, a
key of `PREDICTORS`; never code to import). Inputs are checked before decoding; outputs never overwrite a
file. Evaluation and demos are the clone's (``examples/<family>/``).

Example:
    >>> from deqzoo.predict import PREDICTORS
    >>> sorted(PREDICTORS)[:3]
    ['chains', 'ddim_digits', 'flow']
"""

from __future__ import annotations

import inspect
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .hub.validation import read_json


def free_path(path: str | Path, suffix: str | None = None) -> Path:
    """`path`, or path-1, path-2, ... when a file is there: a prediction never overwrites a user's file;
    with `suffix` (".png"), a path not ending in it is refused.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "flow.png").write_bytes(b"mine")
        >>> free_path(folder / "flow.png").name
        'flow-1.png'
    """
    path = Path(path)
    if suffix is not None and path.suffix.lower() != suffix:
        raise ValueError(f"predict: output {path} must end in {suffix}")
    if not path.exists():
        return path
    for i in range(1, 10000):
        candidate = path.with_name(f"{path.stem}-{i}{path.suffix}")
        if not candidate.exists():
            return candidate
    raise FileExistsError(f"{path}: 10,000 numbered files already exist beside it; choose another name")


def open_image(path: str | Path, label: str, *, max_pixels: int, modes: tuple[str, ...] | None = None):
    """A PIL image, checked before decoding (pixels from the header against `max_pixels`, mode against
    `modes`; bombs and unreadable files): ValueError starting with `label` (FileNotFoundError: no file).

    Example:
        >>> import tempfile
        >>> from PIL import Image
        >>> file = Path(tempfile.mkdtemp()) / "digit.png"
        >>> Image.new("L", (28, 28)).save(file)
        >>> open_image(file, "predict: 'digit.png'", max_pixels=4096 * 4096).size
        (28, 28)
    """
    import warnings

    from PIL import Image, UnidentifiedImageError

    if not Path(path).is_file():
        raise FileNotFoundError(f"{label} names no image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)  # reads the header only
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(f"{label} is {width}x{height} = {width * height:,} pixels, above the "
                                 f"limit of {max_pixels:,}; not decoded")
            if modes is not None and image.mode not in modes:
                raise ValueError(f"{label} has image mode {image.mode!r}; readable modes are "
                                 f"{', '.join(modes)} (save it as an 8-bit PNG or JPEG)")
            image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ValueError(f"{label} is a decompression bomb ({err})") from err
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ValueError(f"{label} is not a readable image ({err})") from err
    return image


# Documented limit of `deqzoo predict` for image classifiers: pixels of the input, checked before decoding.
MAX_IMAGE_PIXELS = 4096 * 4096


@torch.no_grad()
def classify_image(model, input: str) -> str:
    """One line: the label of an image file (any size or mode), the top-3 probabilities, convergence."""
    from .models.mdeq.image_processing_mdeq import MDEQImageProcessor

    image = open_image(input, f"predict: {input!r}", max_pixels=MAX_IMAGE_PIXELS)
    model.eval()
    pixels = MDEQImageProcessor.from_config(model.config)(image, return_tensors="pt")["pixel_values"]
    out = model(pixel_values=pixels.to(torch.float32))
    probs = torch.softmax(out.logits[0].float(), dim=-1)
    top = torch.topk(probs, k=min(3, probs.numel()))
    names = model.config.id2label  # {int: str}, as transformers' config holds it
    ranked = [(names.get(int(i), str(int(i))), float(p)) for p, i in zip(top.values, top.indices)]
    scores = ", ".join(f"{label} {p:.4f}" for label, p in ranked)
    converged = "converged" if bool(out.deq_stats.converged.all()) else "NOT converged"
    return (f"{ranked[0][0]} (top-{len(ranked)} probabilities: {scores}; solve {converged}, "
            f"nfe={out.deq_stats.nfe})")


def load_tokenizer(model):
    """The tokenizer saved with the checkpoint the model was loaded from."""
    from transformers import AutoTokenizer

    from .hub import resolve  # a directory, or a hub id (e.g. the embedded checkpoint): its local directory
    from .integrations.transformers import register_family  # AutoTokenizer may read config.json's type
    from .models.registry import family_for

    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    try:
        folder = resolve(path) if path else None
    except Exception:  # noqa: BLE001 - reported below with the name that failed
        folder = None
    if folder is None or not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json next to the model (name_or_path={path!r}); load the "
                                "model from a checkpoint directory that contains its tokenizer")
    register_family(family_for(model.config.model_type))
    return AutoTokenizer.from_pretrained(folder)


# Documented limit of `deqzoo predict` for the language model (a few pages of text).
MAX_PROMPT_CHARS = 20_000


def generate_text(model, text: str, max_new_tokens: int = 24, decoding: dict | None = None, seed: int = 0,
                  scores: bool = False):
    """`generate()` with the checkpoint's own decoding (its ``generation_config.json``; `decoding` overrides
    it), sampling from a private seeded generator state: the text is reproducible and the caller's RNG is left
    as it was."""
    tok = load_tokenizer(model)
    ids = tok(text, return_tensors="pt")["input_ids"]
    if ids.numel() == 0:
        raise ValueError("the prompt is empty after tokenization")
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        out = model.generate(ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                             pad_token_id=pad, output_logits=scores, **(decoding or {}))
    new = out.sequences[0, ids.shape[1]:]
    text_out = tok.decode(new, skip_special_tokens=True)
    if not scores:
        return text_out, out.past_key_values
    # the model's own distribution (before temperature / top-k / repetition penalty) at each sampled token
    probs = torch.stack([F.softmax(step[0].float(), -1)[t] for step, t in zip(out.logits, new.tolist())])
    return text_out, out.past_key_values, probs


def complete_text(model, input: str, decoding: dict | None = None) -> str:
    """Continuation (24 tokens, the checkpoint's decoding, seeded) of `input` (a text or a text file's path),
    then the model's probability of the sampled tokens (geometric mean, minimum). At most MAX_PROMPT_CHARS."""
    path = Path(input)
    if len(input) < 4096 and path.is_file():
        size = path.stat().st_size
        if size > 4 * MAX_PROMPT_CHARS:  # at most 4 bytes per character in UTF-8
            raise ValueError(f"{path}: {size:,} bytes; predict takes a prompt of at most "
                             f"{MAX_PROMPT_CHARS:,} characters (MAX_PROMPT_CHARS)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: not UTF-8 text ({err})") from err
    else:
        text = input
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"the prompt has {len(text):,} characters; predict takes at most "
                         f"{MAX_PROMPT_CHARS:,} (MAX_PROMPT_CHARS)")
    if not text.strip():
        raise ValueError("the prompt is empty")
    continuation, _, probs = generate_text(model, text, decoding=decoding, scores=True)
    if probs.numel() == 0:
        return continuation
    return (f"{continuation}\n[{probs.numel()} tokens; model probability per token: geometric mean "
            f"{float(probs.log().mean().exp()):.4f}, min {float(probs.min()):.4f}]")


@dataclass
class ChainsDataset:
    """A chains graph: features (N, F), edges (2, E) source->target, labels (N,), and index splits."""

    x: torch.Tensor
    edge_index: torch.Tensor
    labels: torch.Tensor
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    test_idx: torch.Tensor
    num_classes: int
    chains_per_class: int
    chain_length: int

    @property
    def num_nodes(self) -> int:
        return self.x.shape[0]

    def adjacency(self) -> torch.Tensor:
        """The same graph as a torch sparse COO adjacency (A[i, j] = 1 for the edge i -> j)."""
        n, e = self.num_nodes, self.edge_index.shape[1]
        return torch.sparse_coo_tensor(self.edge_index, torch.ones(e), (n, n)).coalesce()


def make_chains(chain_length: int = 10, *, num_classes: int = 2, chains_per_class: int = 20,
                feature_dim: int = 100, num_train: int = 20, num_val: int = 100, num_test: int = 200,
                noise: float = 0.0, seed: int = 42) -> ChainsDataset:
    """Build the chains dataset (deterministic in `seed`; defaults are the original's).

    Node index of (class c, chain k, position p) is ``(c * chains_per_class + k) * chain_length + p``.
    Features are row-normalized as the original's preprocessing does (rows summing to zero stay zero).

    Example:
        >>> ds = make_chains(chain_length=5, chains_per_class=2, num_train=4, num_val=2, num_test=4)
        >>> ds.labels.tolist()[:10], ds.x[0, :2].tolist(), ds.x[1].abs().sum().item()
        ([0, 0, 0, 0, 0, 0, 0, 0, 0, 0], [1.0, 0.0], 0.0)
    """
    if chain_length < 2:
        raise ValueError(f"chain_length must be >= 2, got {chain_length}")
    if num_classes > feature_dim:
        raise ValueError(f"feature_dim ({feature_dim}) must be >= num_classes ({num_classes})")
    n_nodes = num_classes * chains_per_class * chain_length
    if num_train + num_val + num_test > n_nodes:
        raise ValueError(f"splits ({num_train}+{num_val}+{num_test}) exceed the {n_nodes} nodes")
    rng = np.random.RandomState(seed)
    feats = rng.uniform(-noise, noise, size=(num_classes, chains_per_class, chain_length, feature_dim))
    feats[:, :, 0, :num_classes] += np.eye(num_classes).reshape(num_classes, 1, num_classes)
    feats = feats.reshape(-1, feature_dim)
    row_sum = feats.sum(1, keepdims=True)
    with np.errstate(divide="ignore"):
        feats = feats * np.where(row_sum != 0, 1.0 / row_sum, 0.0)
    labels = np.repeat(np.arange(num_classes), chains_per_class * chain_length)
    order = np.arange(n_nodes)
    rng.shuffle(order)
    starts = np.arange(num_classes * chains_per_class)[:, None] * chain_length
    src = (starts + np.arange(chain_length - 1)[None, :]).reshape(-1)
    splits = np.split(order, [num_train, num_train + num_val, num_train + num_val + num_test])[:3]
    return ChainsDataset(torch.from_numpy(feats).float(), torch.from_numpy(np.stack([src, src + 1])).long(),
                         torch.from_numpy(labels).long(), *(torch.from_numpy(s).long() for s in splits),
                         num_classes=num_classes, chains_per_class=chains_per_class,
                         chain_length=chain_length)


def chains_settings(model) -> dict[str, Any]:
    """The dataset settings a checkpoint was trained on (``config.task_specific_params["chains"]``)."""
    params = (getattr(model.config, "task_specific_params", None) or {}).get("chains")
    if not params or "chain_length" not in params:
        raise ValueError("this model's config has no task_specific_params['chains']['chain_length']; it was "
                         "not trained on the chains task (see examples/ignn/train_chains.py)")
    return dict(params)


def node_classifier(model):
    """The node-classification head; a bare IGNNModel cannot classify nodes."""
    if not hasattr(model, "classifier"):
        raise ValueError(f"{type(model).__name__} has no node classifier; load a node-classification "
                         "checkpoint (deqzoo.from_pretrained picks the head from config.architectures)")
    return model


# Documented limits of `deqzoo predict` for graphs: generated chain length, size of a graph JSON file.
MAX_CHAIN_LENGTH = 100_000
MAX_GRAPH_FILE_BYTES = 64 * 1024 * 1024


def classify_nodes(model, input: str) -> str:
    """Node classes of a chain length (``"40"``: a fresh chains graph with the checkpoint's other settings; a
    line per chain) or of a JSON graph file ``{"x": [[...]], "edge_index": [[src...], [dst...]]}`` (optional
    ``"edge_weight"``; class and probability per node)."""
    text = str(input).strip()
    if text.isdigit():
        if not 1 <= int(text) <= MAX_CHAIN_LENGTH:
            raise ValueError(f"chain length {text} is outside [1, {MAX_CHAIN_LENGTH:,}] (MAX_CHAIN_LENGTH)")
        settings = {**chains_settings(model), "chain_length": int(text)}
        ds = make_chains(**settings)
        with torch.no_grad():
            out = node_classifier(model).eval()(ds.x, ds.edge_index)
        conf, pred = out.logits.softmax(-1).max(-1)
        rows = (t.view(-1, ds.chain_length) for t in (pred, ds.labels, conf))
        lines = [f"chain {i:3d} (class {y[0].item()}): predicted {''.join(map(str, p.tolist()))} "
                 f"({(p == y).float().mean().item():.0%} correct, mean probability {c.mean().item():.4f})"
                 for i, (p, y, c) in enumerate(zip(*rows))]
        acc = (pred == ds.labels).float().mean().item()
        return "\n".join([*lines, f"all nodes: accuracy {acc:.4f}; {out.deq_stats.nfe} f-evals"])
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"predict input {text!r} is neither a chain length (an integer) nor a JSON file")
    graph = read_json(path, max_bytes=MAX_GRAPH_FILE_BYTES, max_depth=4)
    for key in ("x", "edge_index"):
        if key not in graph:
            raise ValueError(f"{path}: missing key {key!r}; expected "
                             "{'x': [[...]], 'edge_index': [[...], [...]]}")
    try:
        x = torch.tensor(graph["x"], dtype=torch.float32)
        edge_index = torch.tensor(graph["edge_index"], dtype=torch.long)
        weight = torch.tensor(graph["edge_weight"], dtype=torch.float32) if "edge_weight" in graph else None
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise ValueError(f"{path}: 'x', 'edge_index' and 'edge_weight' must be numeric arrays "
                         f"(x: nodes x features, edge_index: 2 x edges) ({err})") from err
    model = node_classifier(model).eval()
    with torch.no_grad():
        out = model(x, edge_index, weight)
    probs = out.logits.softmax(-1).max(-1)
    pred = probs.indices.tolist()
    scores = [round(float(p), 4) for p in probs.values]
    return (f"{path.name}: {len(pred)} nodes, predicted classes {pred}, their probabilities {scores}; "
            f"{out.deq_stats.nfe} f-evals")


def signal_settings(model) -> dict[str, Any]:
    """The image, size and split a checkpoint was fitted on (``config.task_specific_params["implicit2"]``)."""
    params = (getattr(model.config, "task_specific_params", None) or {}).get("implicit2")
    if not params or "image" not in params or "size" not in params:
        raise ValueError("this model's config has no task_specific_params['implicit2'] with 'image' and "
                         "'size'; it was not fitted by the implicit2 task (see examples/implicit2/)")
    return {"split": "full", **params}


def save_png(image: torch.Tensor, path: Path) -> None:
    """Write a (H, W, C) image in [0, 1] as an 8-bit PNG (grayscale for one channel)."""
    from torchvision.io import write_png

    write_png((image.detach().cpu() * 255.0 + 0.5).clamp(0, 255).to(torch.uint8).permute(2, 0, 1), str(path))


def render_signal(model, input: str) -> str:
    """Render the representation to a PNG. INPUT is ``HxW`` (e.g. ``512x512``), ``Nx`` (e.g. ``2x``: N times
    the fitted resolution), optionally followed by ``:PATH.png``; without a path the file is
    ``implicit2_<image>_<H>x<W>.png`` in the current directory (a numbered name if that exists: an existing
    file is never overwritten)."""
    text = str(input).strip()
    spec, _, target = text.partition(":")
    spec = spec.lower()
    s = signal_settings(model)
    try:
        if spec.endswith("x") and spec[:-1].replace(".", "", 1).isdigit():
            factor = float(spec[:-1])
            h = w = int(round(factor * int(s["size"])))
        else:
            hs, ws = spec.split("x")
            h, w = int(hs), int(ws)
    except ValueError:
        raise ValueError(f"predict input {text!r}: expected 'HxW' (e.g. 512x512) or 'Nx' (e.g. 2x), "
                         "optionally ':out.png'") from None
    if not (1 <= h <= 8192 and 1 <= w <= 8192):
        raise ValueError(f"predict: render size {h}x{w} outside [1, 8192]")
    path = free_path(target or f"implicit2_{s['image']}_{h}x{w}.png", ".png")
    start = time.perf_counter()
    image = model.eval().render(h, w)
    save_png(image, path)
    return f"rendered {s['image']} representation at {h}x{w} to {path} ({time.perf_counter() - start:.1f}s)"


def sample_grid(pipe, path: str | Path, *, n: int = 64, num_inference_steps: int = 10, seed: int = 0):
    """Write an 8-wide PNG grid of `n` DEQ-DDIM samples (each upscaled 4x); returns (path, stats)."""
    from PIL import Image
    from torchvision.utils import make_grid

    out = pipe(batch_size=n, generator=torch.Generator().manual_seed(seed),
               num_inference_steps=num_inference_steps, output_type="np")
    imgs = torch.from_numpy((out.images[..., :1] * 255).round().astype(np.uint8)).permute(0, 3, 1, 2)
    grid = make_grid(imgs, nrow=8, padding=1)[0].numpy()  # black 1-pixel lines between the digits
    Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(path)
    return Path(path), out.deq_stats


def sample_digits(pipe, input: str) -> str:
    """Write a grid of 64 samples to the PNG path `input` (a numbered name if that exists, as every predict
    output: an existing file is never overwritten)."""
    out, stats = sample_grid(pipe, free_path(input, ".png"))
    return f"wrote {out} (64 DEQ-DDIM samples, T=10, {stats.nfe} solver evaluations)"


_MAX_PREDICT_PIXELS = 1024 * 1024  # the all-pairs correlation volume grows with (H·W/64)²


def flow_png(flow: torch.Tensor, path: str | Path) -> Path:
    """Write a (2, H, W) flow as a colour PNG (torchvision's flow_to_image: hue = direction)."""
    from torchvision.io import write_png
    from torchvision.utils import flow_to_image

    write_png(flow_to_image(flow.detach().float().cpu()), str(path))
    return Path(path)


def read_image(path: str) -> torch.Tensor:
    """An image file as a uint8 (C, H, W) tensor (RGB, or RGBA where it has transparency), checked before
    decoding (pixels against _MAX_PREDICT_PIXELS, decompression bombs, unreadable files)."""
    img = open_image(path, f"predict: {path}", max_pixels=_MAX_PREDICT_PIXELS)
    arr = np.asarray(img.convert("RGBA" if img.mode in ("RGBA", "LA", "P") else "RGB"))
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def estimate_flow(model, *inputs: str) -> str:
    """Flow as colour PNGs: ``FIRST SECOND`` image paths (or ``FIRST,SECOND``), optionally ``OUT.png``
    (default ``flow_<first>_<second>.png`` here); or a ``FOLDER`` of video frames (natural name order),
    optionally a new or empty ``OUTDIR``: every consecutive pair with the checkpoint's frame-to-frame reuse
    (``model.estimate_sequence(frames, reuse=True)``). Files are never overwritten (numbered names)."""
    # one argument: the comma form (FIRST,SECOND); several: one path each (a comma may be in a path)
    parts = [p.strip() for p in (inputs[0].split(",") if len(inputs) == 1 else inputs)]
    input = " ".join(inputs)
    if parts and parts[0] and Path(parts[0]).is_dir():
        if len(parts) > 2 or not all(parts):
            raise ValueError(f"predict input {input!r}: expected FOLDER of frames, optionally OUTDIR")
        return _predict_video(model, Path(parts[0]), Path(parts[1]) if len(parts) == 2 else None)
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"predict input {input!r}: expected FIRST SECOND image paths, optionally OUT.png")
    a, b = read_image(parts[0]), read_image(parts[1])
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"predict: {parts[0]} is {tuple(a.shape[-2:])} (H, W) but {parts[1]} is "
                         f"{tuple(b.shape[-2:])}; the two frames must have the same size")
    path = free_path(parts[2] if len(parts) == 3 else f"flow_{Path(parts[0]).stem}_{Path(parts[1]).stem}.png",
                     ".png")
    with torch.no_grad():
        out = model.eval()(a[None], b[None])
    flow_png(out.flow[0], path)
    mag = torch.linalg.vector_norm(out.flow[0], dim=0)
    nfe = f", {out.deq_stats.nfe} f-evaluations" if out.deq_stats is not None else ""
    return (f"flow {parts[0]} -> {parts[1]} ({a.shape[-2]}x{a.shape[-1]}): mean |flow| "
            f"{float(mag.mean()):.2f} px, max {float(mag.max()):.2f} px{nfe}; written to {path}")


_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
# The flows of a whole video are held until they are written: at most this many pixels over all frames
# (256 MiB of float32 flow).
_MAX_VIDEO_PIXELS = 32 * 1024 * 1024


def video_frames(folder: Path) -> list[Path]:
    """The frames of a video folder in name order, checked (count, sizes) before any is decoded."""
    from PIL import Image

    frames = sorted((p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in _FRAME_SUFFIXES),
                    key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)])
    if len(frames) < 2:
        raise ValueError(f"predict: {folder} holds {len(frames)} image(s) ({', '.join(_FRAME_SUFFIXES)}); a "
                         "video needs at least 2 frames")
    sizes = []
    for path in frames:
        with Image.open(path) as img:  # reads the header only
            sizes.append(img.size)
        if sizes[-1] != sizes[0]:
            raise ValueError(f"predict: {path} is {sizes[-1][1]}x{sizes[-1][0]} (H x W) but {frames[0]} is "
                             f"{sizes[0][1]}x{sizes[0][0]}; every frame of a video must have the same size")
    w, h = sizes[0]
    if len(frames) * w * h > _MAX_VIDEO_PIXELS:
        raise ValueError(f"predict: {folder} holds {len(frames)} frames of {h}x{w}, {len(frames) * w * h:,} "
                         f"pixels in all; at most {_MAX_VIDEO_PIXELS:,} (the flows are held until written): "
                         "split the video")
    return frames


class _LazyFrames:
    """A video's frames, decoded when the solve asks for them (not all held at once)."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return read_image(str(self.paths[i]))


def _predict_video(model, folder: Path, out_dir: Path | None) -> str:
    frames = video_frames(folder)
    if out_dir is None:
        out_dir = free_path(Path(f"flow_{folder.resolve().name}"))
    elif out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"predict: output folder {out_dir} is a file; choose a new folder")
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"predict: output folder {out_dir} exists and is not empty; choose a new one")
    with torch.no_grad():
        flows, stats = model.eval().estimate_sequence(_LazyFrames(frames), reuse=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    for a, b, f in zip(frames, frames[1:], flows):
        flow_png(f, free_path(out_dir / f"flow_{a.stem}_{b.stem}.png"))  # a.png and a.jpg: both kept
    h, w = flows[0].shape[-2:]
    nfe, later = "", [int(s.nfe) for s in stats[1:] if s is not None]
    if stats[0] is not None:
        nfe = f"; {int(stats[0].nfe)} f-evaluations for the first pair" + (
            f", {sum(later) / len(later):.1f} per pair after it (each starts from the previous fixed point)"
            if later else "")
    return f"{len(frames)} frames of {h}x{w} in {folder}: {len(flows)} flows{nfe}; written to {out_dir}"


def solve_grid(model, input: str) -> str:
    """Solve an n×n Sudoku given as its cells row by row (digits, "0" or "." for blanks; spaces, "/" and
    newlines ignored) with a grid reasoner at its trained budget, halting per its config; the answer's rows.

    Example (a held-out puzzle; the embedded trm-sudoku6 solves it in its 4 trained segments):
        >>> import deqzoo
        >>> solve_grid(deqzoo.from_pretrained("trm-sudoku6"), "6..... ...41. .51.6. ...3.. .....3 .6..4.")
        '614532 / 532416 / 351264 / 426351 / 145623 / 263145 (4 segments)'
    """
    cells = [c for c in input if not c.isspace() and c != "/"]
    n = math.isqrt(model.config.seq_len)
    if len(cells) != n * n or any(c != "." and not c.isdigit() for c in cells):
        raise ValueError(f"a puzzle is {n * n} cells (digits, 0 or . for blanks), got {input!r}")
    givens = torch.tensor([[0 if c == "." else int(c) for c in cells]])
    if int(givens.max()) > n:
        raise ValueError(f"a {n}x{n} puzzle's digits are 1..{n}, got {int(givens.max())} in {input!r}")
    with torch.no_grad():
        out = model.eval()(givens)
    answer = out.logits.argmax(-1)[0].tolist()
    rows = ["".join(map(str, answer[r * n:(r + 1) * n])) for r in range(n)]
    return " / ".join(rows) + f" ({int(out.steps[0])} segments)"


# task name (a card's `deqzoo_task`) -> its predict function (model, *inputs) -> one printable result
PREDICTORS: dict[str, Callable[..., str]] = {
    "mnist": classify_image,
    "pydoc_lm": complete_text,
    "pystd_lm": complete_text,
    "chains": classify_nodes,
    "implicit2": render_signal,
    "ddim_digits": sample_digits,
    "flow": estimate_flow,
    "sudoku6": solve_grid,
    "sudoku9": solve_grid,
}


def predict(model, task: object, inputs: list[str]) -> str:
    """Run `model` on `inputs` with the predict function of `task` (a card's ``deqzoo_task`` value); one
    input except for a task whose function takes several (optical flow: two images)."""
    if not isinstance(task, str) or task not in PREDICTORS:
        raise ValueError(f"deqzoo_task {task!r} is not a registered task; registered tasks: "
                         f"{sorted(PREDICTORS)}")
    function = PREDICTORS[task]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(function).parameters.values())
    if len(inputs) != 1 and not variadic:
        raise ValueError(f"the {task} task takes one INPUT, got {len(inputs)}: {inputs}")
    return function(model, *inputs)
