"""The reasoner tab's computations (issue #56 item 8), on a tiny random-init reasoner saved into a temporary
folder and passed by path ($DEQZOO_APP_REASONER), as the tab uses it until a reasoner checkpoint is embedded:
the answer after each segment is the model's own answer at that budget, halting is the model's per-sample
rule, and bad puzzles are refused naming the cell."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification


def tiny_reasoner(folder, seed: int = 0) -> str:
    torch.manual_seed(seed)
    cfg = ReasonerConfig(seq_len=36, vocab_size=7, num_labels=7, hidden_size=16, num_heads=2, num_layers=1,
                         mixer="mlp", pos_encodings="learned", h_cycles=1, l_cycles=2, halt_max_steps=3,
                         architectures=["ReasonerForGridClassification"])
    ReasonerForGridClassification(cfg).save_pretrained(folder)
    return str(folder)


@pytest.fixture()
def tab(tmp_path, monkeypatch):
    from deqzoo_app import families as F
    from deqzoo_app import reasoner as R

    if F.CHECKPOINTS.get("reasoner"):
        pytest.skip("a reasoner checkpoint is embedded: the tab runs it (tested by the browser test)")
    monkeypatch.setenv(R.ENV, tiny_reasoner(tmp_path / "tiny"))
    return R


def test_answer_after_each_segment_is_the_models_answer_at_that_budget(tab):
    grid = tab.heldout_puzzle(7)
    page, fig, summary = tab.solve_sudoku(grid, 5, "budget")
    model = ReasonerForGridClassification.from_pretrained(tab.checkpoint()).eval()
    x = torch.from_numpy(tab.parse_grid(grid))[None]
    with torch.no_grad():
        trace = tab._trace(model, x, 5, tab.F.Deadline())
        for k in range(1, 6):  # an independent run of k segments from the initial state
            logits = model(x, num_segments=k, halting="budget").logits[0]
            digits = logits[:, 1:].argmax(-1).numpy() + 1  # the tab's answer is over digits 1..6
            np.testing.assert_array_equal(trace["answers"][k - 1], digits)
    assert page.count("seg. ") == 5 and "stopped at segment **5** of 5" in summary
    assert f"({sum(bool(v) for row in grid for v in row)} givens)" in summary


def test_halting_point_is_the_models_own(tab):
    model = ReasonerForGridClassification.from_pretrained(tab.checkpoint()).eval()
    grid = tab.heldout_puzzle(1)
    x = torch.from_numpy(tab.parse_grid(grid))[None]
    for rule in ("stability", "act", "residual"):
        with torch.no_grad():
            steps = int(model(x, num_segments=6, halting=rule).steps[0])
        _, _, summary = tab.solve_sudoku(grid, 6, rule)
        assert f"stopped at segment **{steps}** of 6" in summary, (rule, summary)


def test_bad_puzzles_are_refused_by_cell(tab):
    grid = tab.heldout_puzzle(0)
    with pytest.raises(ValueError, match="6 rows of 6 cells"):
        tab.solve_sudoku(grid[:5])
    bad = [row[:] for row in grid]
    bad[2][4] = "x"
    with pytest.raises(ValueError, match=r"row 3, column 5\) must be a digit 1..6"):
        tab.solve_sudoku(bad)
    bad = [[""] * 6 for _ in range(6)]
    bad[0][0] = bad[0][5] = "4"
    with pytest.raises(ValueError, match=r"row 1, column 1\) and \(row 1, column 6\) are both 4"):
        tab.solve_sudoku(bad)
    with pytest.raises(ValueError, match="halting rule"):
        tab.solve_sudoku(grid, 2, "forever")
    # a caller that bypasses the page gets the slider's range
    _, _, summary = tab.solve_sudoku(grid, 10**6, "budget")
    assert f"of {tab.F.LIMITS['segments'][1]}" in summary


def test_no_checkpoint_no_tab(monkeypatch):
    pytest.importorskip("gradio", reason="the tab list is the UI's (deqzoo[app])")
    from deqzoo_app import families as F
    from deqzoo_app import reasoner as R
    from deqzoo_app import ui

    if F.CHECKPOINTS.get("reasoner"):
        pytest.skip("a reasoner checkpoint is embedded")
    monkeypatch.delenv(R.ENV, raising=False)
    assert not R.available() and "Reasoner (Sudoku)" not in ui._tabs()
    with pytest.raises(ValueError, match="no reasoner checkpoint"):
        R.solve_sudoku(R.heldout_puzzle(0))
