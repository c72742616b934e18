"""The reasoner tab's layout (Gradio) over `deqzoo_app.reasoner`; `deqzoo_app.ui` adds it when the app has a
reasoner checkpoint."""

from __future__ import annotations

import gradio as gr

from . import reasoner as R
from .ui import _click, _slider


def reasoner_tab() -> None:
    gr.Markdown(
        "**Recursive reasoner** (TRM-style): one small network applied again and again to its own answer "
        "and latent state. Edit the 6×6 puzzle (digits 1-6, empty = blank), choose the compute (segments) "
        "and the halting rule, and see the answer after every segment with each cell's confidence."
    )
    with gr.Row():
        with gr.Column(scale=2):
            grid = gr.Dataframe(value=R.heldout_puzzle(0), headers=[str(c + 1) for c in range(R.SIZE)],
                                row_count=R.SIZE, column_count=R.SIZE, type="array",
                                datatype="str", interactive=True, label="puzzle (edit the cells)",
                                elem_id="reasoner-grid")
            with gr.Row():
                index = _slider("puzzle", 0, 1, "held-out puzzle number")
                load = gr.Button("Load held-out puzzle")
        with gr.Column(scale=1):
            segments = _slider("segments", 8, 1, "compute: segments",
                               info="the trained budget is the checkpoint's halt_max_steps")
            halting = gr.Dropdown(list(R.RULES), value="stability", label="halting rule")
            run = gr.Button("Solve", variant="primary")
    answers = gr.HTML(elem_id="reasoner-answers")
    with gr.Row():
        plot = gr.Plot(label="confidence per segment")
        summary = gr.Markdown(elem_id="reasoner-summary")
    load.click(R.heldout_puzzle, [index], [grid], api_name="reasoner_puzzle")
    _click(run, R.solve_sudoku, [grid, segments, halting], [answers, plot, summary], "solve_sudoku",
           "reasoner")
