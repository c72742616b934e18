"""The app's layout: one Gradio tab per family over `deqzoo_app.families`. Every computation is an API
endpoint (``api_name``), so `gradio_client` reaches each tab without a browser."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import gradio as gr

from examples.deq_transformer.pystd_lm import DEMO_PROMPT

from . import families as F
from . import looped_lm

_SOLVER_HELP = "the fixed-point solver the model's equilibrium is found with"
_LOG = logging.getLogger("deqzoo_app")


def _errors(fn: Callable) -> Callable:
    """A bad input becomes a `gr.Error` with the library's message (shown in the page, sent to clients, no
    traceback printed: it is the user's input, not the server, at fault); anything else becomes a short
    message too, its traceback logged once on the server."""

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        try:
            return fn(*args)
        except (ValueError, OSError) as err:  # TimeoutError included
            raise gr.Error(str(err), print_exception=False) from None
        except Exception as err:
            _LOG.exception("deqzoo app: %s failed", getattr(fn, "__name__", "a request"))
            raise gr.Error(f"the request failed ({type(err).__name__}); the server logged it",
                           print_exception=False) from None

    return wrapped


def _slider(limit: str, value: float, step: float, label: str, **kwargs: Any) -> gr.Slider:
    """A slider over `F.LIMITS[limit]`: the range the server clamps API values to."""
    low, high = F.LIMITS[limit]
    return gr.Slider(low, high, value=value, step=step, label=label, **kwargs)


def _click(button: gr.Button, fn: Callable, inputs: list, outputs: list, api_name: str, group: str) -> None:
    # one request per tab at a time (its models' solver settings are per request), tabs side by side
    button.click(_errors(fn), inputs, outputs, api_name=api_name, concurrency_id=group, concurrency_limit=1)


def _budget_controls(max_iter: int, tol: float, solver: bool = True) -> list:
    controls = []
    if solver:
        controls.append(gr.Dropdown(list(F.SOLVERS), value="anderson", label="solver", info=_SOLVER_HELP))
    controls.append(
        _slider("max_iter", max_iter, 1, "iteration budget (f_max_iter)",
                info="test-time compute: the most f-evaluations one solve may take")
    )
    low, high = F.LIMITS["tol"]
    controls.append(
        gr.Number(value=tol, label="tolerance (f_tol, relative residual)", minimum=low, maximum=high)
    )
    return controls


def _mdeq_tab() -> None:
    gr.Markdown(
        "**MDEQ** (multiscale deep equilibrium model) classifies an image by solving for the "
        "equilibrium of one layer. Draw a digit or upload a picture of one; move the budget and "
        "tolerance and watch accuracy, NFE and time on 200 held-out MNIST digits react."
    )
    with gr.Row():
        with gr.Column():
            sketch = gr.Sketchpad(
                label="draw a digit",
                type="numpy",
                height=280,
                width=280,
                canvas_size=(280, 280),
                brush=gr.Brush(default_size=18, colors=["#000000"], color_mode="fixed"),
            )
            upload = gr.File(label="...or upload an image", file_types=["image"], type="filepath")
            example = gr.Dropdown(list(range(10)), value=3, label="...or take a held-out MNIST digit")
        with gr.Column():
            checkpoint = gr.Dropdown(
                F.CHECKPOINTS["mdeq"], value=F.CHECKPOINTS["mdeq"][0], label="checkpoint"
            )
            controls = _budget_controls(30, 1e-4)
            run = gr.Button("Classify", variant="primary")
    with gr.Row():
        seen = gr.Image(label="what the model sees (28x28)", height=140, width=140, interactive=False)
        probs = gr.Label(num_top_classes=3, label="class probabilities")
    with gr.Row():
        plot = gr.Plot(label="residual per iteration")
        summary = gr.Markdown(elem_id="mdeq-summary")

    def classify(drawing, upload_path, digit, checkpoint, solver, max_iter, tol):
        if upload_path:
            source = upload_path
        elif (
            drawing is not None
            and isinstance(drawing, dict)
            and drawing.get("composite") is not None
            and drawing["composite"][..., -1].any()
        ):
            source = drawing
        else:
            source = F.sample_digit(digit)
        labels, fig, text, image = F.classify_digit(source, checkpoint, solver, max_iter, tol)
        return labels, fig, text, image

    _click(run, classify, [sketch, upload, example, checkpoint, *controls], [probs, plot, summary, seen],
           "classify_digit", "mdeq")


def _transformer_tab() -> None:
    gr.Markdown(
        "**DEQ-Transformer** is a language model whose layers are one equilibrium. Each new token's "
        "solve starts from the cached fixed point; the colours show how many f-evaluations each "
        "generated token took (1.4M parameters, trained on Python's documentation and standard library "
        "source; its card compares it with an explicit twin)."
    )
    with gr.Row():
        with gr.Column():
            prompt = gr.Textbox(DEMO_PROMPT, label="prompt", lines=2)
            tokens = _slider("new_tokens", 24, 1, "new tokens")
            seed = gr.Number(0, label="seed", precision=0)
        with gr.Column():
            controls = _budget_controls(30, 1e-3)
            run = gr.Button("Generate", variant="primary")
    text = gr.HighlightedText(label="generation (NFE per token)", combine_adjacent=False, show_legend=False)
    with gr.Row():
        plot = gr.Plot(label="f-evaluations per generated token")
        summary = gr.Markdown(elem_id="transformer-summary")

    def generate(prompt, tokens, seed, solver, max_iter, tol):
        return F.generate_text(prompt, tokens, solver, max_iter, tol, seed)

    _click(run, generate, [prompt, tokens, seed, *controls], [text, plot, summary], "generate", "transformer")


def _flow_tab() -> None:
    gr.Markdown(
        "**DEQ-Flow** estimates optical flow as the fixed point of RAFT's update block. Along a video "
        "each pair can start from the previous pair's fixed point, moved with the motion: the table "
        "shows the f-evaluations with and without that reuse. Upload two frames or all the frames of "
        "a short video (names in natural order), or run the example with known motion."
    )
    with gr.Row():
        frames = gr.File(
            label="frames (2 to 16 images of one size)",
            file_count="multiple",
            file_types=["image"],
            type="filepath",
        )
        with gr.Column():
            run = gr.Button("Flow of my frames", variant="primary")
            example = gr.Button("Flow of the example video (known motion)")
    with gr.Row():
        first = gr.Image(label="frame 1", interactive=False, height=180)
        second = gr.Image(label="frame 2", interactive=False, height=180)
        wheel = gr.Image(
            label="colour key (direction = hue, magnitude = saturation)", interactive=False, height=180
        )
    flows = gr.Gallery(label="flow per pair", columns=4, height=220)
    with gr.Row():
        plot = gr.Plot(label="residual per iteration")
        summary = gr.Markdown(elem_id="flow-summary")
    outputs = [first, second, flows, wheel, plot, summary]
    _click(run, lambda files: F.flow_frames(files), [frames], outputs, "flow_frames", "flow")
    _click(example, lambda: F.flow_example(), [], outputs, "flow_example", "flow")


def _implicit2_tab() -> None:
    gr.Markdown(
        "**Implicit²** represents a picture as an implicit network of its coordinates, whose output is "
        "an equilibrium. It has no pixel grid: render it at any zoom, and compare with the pixels it "
        "was fitted on."
    )
    with gr.Row():
        checkpoint = gr.Dropdown(
            F.CHECKPOINTS["implicit2"], value=F.CHECKPOINTS["implicit2"][0], label="checkpoint"
        )
        zoom = _slider("zoom", 4, 0.5, "zoom")
        cx = _slider("centre", 0.0, 0.01, "centre x (column)")
        cy = _slider("centre", -0.2, 0.01, "centre y (row)")
        res = _slider("resolution", 128, 16, "render resolution")
    run = gr.Button("Render", variant="primary")
    with gr.Row():
        render = gr.Image(label="implicit representation", interactive=False, height=300)
        reference = gr.Image(label="fitted pixels, same window", interactive=False, height=300)
    summary = gr.Markdown(elem_id="implicit2-summary")
    _click(run, F.render_inr, [checkpoint, zoom, cx, cy, res], [render, reference, summary], "render_inr",
           "implicit2")


def _ddim_tab() -> None:
    gr.Markdown(
        "**DEQ-DDIM** solves a whole DDIM sampling chain as one fixed point over all T states. Same "
        "noise, same UNet: DDIM takes T UNet calls one after another; DEQ-DDIM's sequential depth is "
        "the number of batched chain evaluations."
    )
    with gr.Row():
        steps = _slider("ddim_steps", 10, 1, "steps T")
        seed = gr.Number(0, label="seed", precision=0)
        batch = _slider("ddim_images", 2, 1, "images")
        solver = gr.Dropdown(["anderson", "fixed_point"], value="anderson", label="solver")
        tol = gr.Number(1e-3, label="tolerance")
    run = gr.Button("Sample with both", variant="primary")
    ddim = gr.Image(label="DDIM (diffusers)", interactive=False)
    deq = gr.Image(label="DEQ-DDIM", interactive=False)
    summary = gr.Markdown(elem_id="ddim-summary")
    _click(run, F.ddim_compare, [steps, seed, batch, solver, tol], [ddim, deq, summary], "ddim_compare",
           "ddim")


def _ignn_tab() -> None:
    gr.Markdown(
        "**IGNN** (implicit graph neural network) propagates information along a graph until "
        "equilibrium, so it reaches nodes any number of hops away. In the chains task only the first "
        "node of each chain knows the chain's class; every node must be classified."
    )
    with gr.Row():
        length = _slider("chain_length", 100, 1, "chain length")
        budget = _slider("chain_budget", 140, 1, "iteration budget (fixed-point steps)")
    run = gr.Button("Classify every node", variant="primary")
    picture = gr.Image(
        label="one row per chain, one column per position: green right, red wrong", interactive=False
    )
    with gr.Row():
        plot = gr.Plot(label="accuracy by position")
        summary = gr.Markdown(elem_id="ignn-summary")
    _click(run, F.ignn_chains, [length, budget], [picture, plot, summary], "ignn_chains", "ignn")


def _hyper_tab() -> None:
    gr.Markdown(
        "**HyperDEQ**: a hypersolver is a small network trained to solve one checkpoint's fixed "
        "points (a learned initial guess and learned Anderson mixing). Here it races Anderson on the "
        "MNIST checkpoint: same digits, budget and tolerance."
    )
    with gr.Row():
        # the hypersolver card's setting (the model's budget and tolerance, a batch of 100 digits)
        controls = _budget_controls(20, 1e-3, solver=False)
        images = _slider("held_out", 100, 10, "held-out digits")
    run = gr.Button("Race", variant="primary")
    with gr.Row():
        plot = gr.Plot(label="residual per iteration")
        summary = gr.Markdown(elem_id="hyper-summary")
    _click(run, F.hyper_vs_anderson, [*controls, images], [plot, summary], "hyper_vs_anderson", "hypersolver")


TABS = {
    "MDEQ (MNIST)": _mdeq_tab,
    "DEQ-Transformer": _transformer_tab,
    "DEQ-Flow": _flow_tab,
    "Implicit²": _implicit2_tab,
    "DEQ-DDIM": _ddim_tab,
    "IGNN": _ignn_tab,
    "Hypersolver": _hyper_tab,
    "Looped LM": looped_lm.tab,
}


def _tabs() -> dict:
    from . import reasoner

    if not reasoner.available():  # no embedded reasoner and no $DEQZOO_APP_REASONER: no tab
        return TABS
    from .reasoner_ui import reasoner_tab

    return {**TABS, "Reasoner (Sudoku)": reasoner_tab}


def theme() -> gr.themes.Base:
    # system fonts: the default theme fetches web fonts, which an offline machine cannot reach
    return gr.themes.Default(
        font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"]
    )


def build(warm_up: bool = True) -> gr.Blocks:
    if warm_up:
        F.warm_up()
    with gr.Blocks(title="deqzoo", analytics_enabled=False) as demo:
        gr.Markdown(
            "# deqzoo: deep equilibrium models\nEvery tab runs an embedded checkpoint on this machine, "
            "offline. The solver settings are a test-time knob: see what more or less compute buys."
        )
        with gr.Tabs():
            for name, make in _tabs().items():
                with gr.Tab(name):
                    make()
    return demo
