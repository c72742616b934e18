"""`deqzoo demo`'s output a person reads: the table within 100 columns, residual plots with the solve's
tolerance drawn, no plot (and no NFE 0 row) for a model without a solve, flow figures with frames, ground
truth, prediction and colour key, and index.html showing every PNG written."""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from deqzoo.core import SolverStats, solve
from examples.demo import (
    DEMO_WIDTH,
    DemoSummary,
    _demo_row,
    _without_scratch,
    card_demo,
    card_label,
    demo_table,
    has_solve,
    residual_figure,
    run_demo,
    write_index,
)
from examples.deq_flow import flow

pytest.importorskip("matplotlib")
pytest.importorskip("torchvision")


def _linear_solve(solver: str, tol: float, stop_mode: str, max_iter: int = 60, dtype=torch.float64):
    """A hard case: a non-normal, ill-conditioned linear contraction z -> A z + b (spectral radius 0.9,
    ||A||_2 > 1, so plain iteration's residual first grows)."""
    g = torch.Generator().manual_seed(0)
    n = 12
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    upper = torch.triu(torch.randn(n, n, generator=g, dtype=torch.float64), 1) * 0.8
    a = (q @ (torch.diag(torch.linspace(-0.9, 0.9, n, dtype=torch.float64)) + upper) @ q.T).to(dtype)
    b = torch.randn(3, n, generator=g, dtype=torch.float64).to(dtype)
    return solve(lambda z: z @ a.T + b, torch.zeros_like(b), solver=solver, max_iter=max_iter, tol=tol,
                 stop_mode=stop_mode)[1]


@pytest.mark.parametrize("stop_mode,tol,dtype", [("abs", 1e-6, torch.float64), ("rel", 1e-3, torch.float32)])
def test_residual_figure_draws_each_trace_and_the_tolerance(stop_mode, tol, dtype):
    card = _linear_solve("anderson", tol, stop_mode, dtype=dtype)
    short = _linear_solve("fixed_point", tol, stop_mode, max_iter=4, dtype=dtype)  # stops above tol
    assert card.all_converged and not short.all_converged and card.tol == tol
    fig = residual_figure({"anderson (card)": card, "fixed_point": short}, "toy: forward solve")
    (ax,) = fig.axes
    tol_lines = [ln for ln in ax.lines if list(ln.get_xdata()) == [0, 1]]  # axhline: axes-fraction x
    assert len(tol_lines) == 1
    line = tol_lines[0]
    assert list(line.get_ydata()) == [tol, tol] and line.get_transform() == ax.get_yaxis_transform()
    assert line.get_label() == f"tolerance f_tol={tol:.0e} ({stop_mode})"
    curves = {ln.get_label(): np.asarray(ln.get_ydata()) for ln in ax.lines if ln is not line}
    assert set(curves) == {f"anderson (card): {card.nfe} NFE, converged",
                           f"fixed_point: {short.nfe} NFE, not converged"}
    drawn = curves[f"anderson (card): {card.nfe} NFE, converged"]
    np.testing.assert_allclose(drawn, card.trace.double().numpy(), rtol=1e-12)
    # the picture says what the table says: the card's curve ends below the line, the capped one above
    assert drawn[-1] < tol < curves[f"fixed_point: {short.nfe} NFE, not converged"][-1]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == f"max {stop_mode} residual"
    assert ax.get_legend() is not None


def test_residual_figure_refuses_a_model_without_a_solve():
    assert not has_solve(SolverStats.no_solve()) and not has_solve(None)
    with pytest.raises(ValueError, match="raft: no solve with a residual trace"):
        residual_figure({"card": SolverStats.no_solve()}, "raft")


def test_demo_table_fits_100_columns_and_keeps_every_word():
    stats = _linear_solve("anderson", 1e-6, "abs")
    capped = _linear_solve("fixed_point", 1e-6, "abs", max_iter=3)
    long_metric = DemoSummary("full line", "EPE 2.40 px held-out, 2.32 px motorcycle, and a much longer tail")
    rows = [
        _demo_row("deqzoo/implicit2-igabor-mfn-camera-with-a-very-long-name", "anderson", True, long_metric,
                  stats, 12.345),
        _demo_row("deqzoo/implicit2-igabor-mfn-camera-with-a-very-long-name", "fixed_point", False,
                  long_metric, capped, 0.5),
        _demo_row("deqzoo/deq-flow-cpu-raft-baseline", "anderson", True, "plain summary without a metric",
                  SolverStats.no_solve(), 5.0),
    ]
    table = demo_table(rows)
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= DEMO_WIDTH
    assert lines[0].split() == ["model", "solver", "metric", "NFE", "residual", "converged", "time"]
    # read the columns back (their spans from the dashes; a row starts at the line holding its time, the
    # lines below it continue its wrapped cells): every cell's text is there, wrapped, not cut
    spans = [m.span() for m in re.finditer(r"-+", lines[1])]
    groups: list[list[str]] = []
    for line in lines[2:]:
        if line[spans[-1][0]:].strip():
            groups.append([])
        groups[-1].append(line)
    parsed = [["".join(line[a:b].replace(" ", "") for line in group) for a, b in spans] for group in groups]
    from examples.demo import _demo_cells

    assert parsed == [[c.replace(" ", "") for c in _demo_cells(r)] for r in rows]
    words = table.split()
    assert "anderson*" in words and "12.35s" in words and str(stats.nfe) in words
    assert f"{float(stats.residual.max()):.1e}" in words and "abs" in words
    assert re.search(r"fixed_point\s+.*\b3\b.*abs\s+no\s", table)  # the capped solve: NFE 3, not converged
    raft = next(line for line in lines if line.startswith("deq-flow-cpu-raft-baseline"))
    assert raft.split()[1:4] == ["no", "solve", "plain"] and " 0 " not in raft and "e+00" not in raft
    assert raft.split()[-4:] == ["-", "-", "-", "5.00s"]  # NFE, residual, converged: not 0 / 0 / yes


def test_flow_figure_panels_frames_truth_prediction_and_key():
    from torchvision.utils import flow_to_image

    pair = flow.synthetic_pair(0, (48, 64), "held-out")
    assert not bool(pair.valid.all())  # occlusions: the ground truth has pixels without a value
    fig = flow.flow_figure(pair, pair.image1, pair.image2, pair.flow, "pair 0")
    titles = [ax.get_title() for ax in fig.axes]
    # one scale for both: the truth's largest valid flow or the prediction's (here the unmasked truth)
    truth_max = float(torch.linalg.vector_norm(torch.where(pair.valid[None], pair.flow, 0), dim=0).max())
    scale = float(torch.linalg.vector_norm(pair.flow, dim=0).max())
    assert scale > truth_max
    assert titles == ["frame 1", "frame 2", "ground truth (black: none)", "predicted, EPE 0.00 px",
                      f"colour key\n(rim = {scale:.1f} px)"]
    shown = [ax.get_images()[0].get_array() for ax in fig.axes]
    for image, frame in zip(shown[:2], (pair.image1, pair.image2)):
        np.testing.assert_array_equal(image, (frame * 255 + 0.5).to(torch.uint8).permute(1, 2, 0).numpy())
    truth, pred = np.asarray(shown[2]), np.asarray(shown[3])
    valid = pair.valid.numpy()
    assert (truth[~valid] == 0).all()  # no ground truth: black
    np.testing.assert_array_equal(truth[valid], pred[valid])  # one colour scale for truth and prediction
    # the key: the pixel at direction d on the rim has flow_to_image's colour of a full-length flow along d
    key = np.asarray(shown[4])
    n = key.shape[0]
    c = n // 2
    for (row, col), (u, v) in {(c, n - 1): (1.0, 0.0), (n - 1, c): (0.0, 1.0), (c, 0): (-1.0, 0.0),
                               (0, c): (0.0, -1.0)}.items():
        expected = flow_to_image(torch.tensor([u, v]).view(2, 1, 1))[:, 0, 0].numpy()
        np.testing.assert_allclose(key[row, col].astype(int), expected.astype(int), atol=2)
    assert (key[0, 0] == 255).all()  # outside the wheel
    assert fig.axes[4].get_images()[0].get_extent() == [-scale, scale, scale, -scale]
    # a pair without ground truth: frames, prediction and key only
    fig = flow.flow_figure(None, pair.image1, pair.image2, pair.flow, "no truth")
    assert [ax.get_title() for ax in fig.axes][:3] == ["frame 1", "frame 2", "predicted"]


def test_index_html_escapes_text_and_links_images_relatively(tmp_path):
    from PIL import Image

    for name in ("a b.png", "c&d.png"):
        Image.new("RGB", (2, 2)).save(tmp_path / name)
    page = write_index(tmp_path / "index.html", ["model", "<metric>"], [["m<1>", 'x"&y']],
                       {"sec <1>": [tmp_path / "a b.png", tmp_path / "c&d.png"]}, intro="<script>")
    text = page.read_text(encoding="utf-8")
    assert "<script" not in text and "&lt;script&gt;" in text and "&lt;metric&gt;" in text
    assert "<td>m&lt;1&gt;</td>" in text and "x&quot;&amp;y" in text and "sec &lt;1&gt;" in text
    assert re.findall(r'<img src="([^"]+)"', text) == ["a%20b.png", "c%26d.png"]
    assert "http" not in text
    elsewhere = tmp_path.parent / "outside.png"
    with pytest.raises(ValueError, match="outside.png: the page .* links images in its own folder only"):
        write_index(tmp_path / "index.html", ["h"], [], {"s": [elsewhere]})


def _srcs(page: Path) -> set[str]:
    return {html.unescape(s) for s in re.findall(r'<img src="([^"]+)"', page.read_text(encoding="utf-8"))}


def test_demo_of_the_raft_twin_shows_no_solve_and_writes_no_residual_plot(tmp_path):
    """The catalog's RAFT twin (deq-flow-cpu-raft-baseline) is an explicit network: its row says so (no NFE
    0, no residual 0), no residual PNG is written and no comparison solver runs; its flow figures are on the
    page."""
    name = "deqzoo/deq-flow-cpu-raft-baseline"
    rows, failures = run_demo([name], tmp_path, progress=False)
    assert not failures and len(rows) == 1
    (row,) = rows
    assert row["solver"] == "no solve" and row["NFE"] is None and row["residual"] is None
    assert row["converged"] is None and row["metric"].startswith("EPE ")
    pngs = {p.name for p in tmp_path.glob("*.png")}
    assert pngs == {"deq-flow-cpu-raft-baseline_held_out_flow.png",
                    "deq-flow-cpu-raft-baseline_motorcycle_flow.png"}
    assert _srcs(tmp_path / "index.html") == pngs
    line = demo_table(rows).splitlines()[2]
    assert line.split()[1:3] == ["no", "solve"] and line.split()[-4:-1] == ["-", "-", "-"]


def test_demo_of_a_reversible_deq_compares_no_solvers(tmp_path):
    """A reversible DEQ (b_mode="reversible") runs its own coupled iteration whatever `f_solver` says, so the
    demo shows its card's solve only: one row, one residual plot, no identical 'comparison' rows."""
    name = "deqzoo/mdeq-tiny-mnist-reversible"
    rows, failures = run_demo([name], tmp_path, progress=False)
    assert failures == []
    assert len(rows) == 1 and rows[0]["card"] and rows[0]["solver"] == "reversible"  # what ran, not f_solver
    assert (tmp_path / "mdeq-tiny-mnist-reversible_residuals.png").is_file()


def test_the_reversible_plot_names_the_coupled_steps_it_draws(tmp_path):
    """The reversible card's residual curve is labelled as what ran (its coupled steps, one trace point each)
    with its f calls, not as the f_solver the config also carries."""
    _, stats, model, _, _ = card_demo("deqzoo/mdeq-tiny-mnist-reversible", tmp_path)
    config = model.config.deq_config
    label = card_label(config, stats)
    assert label == f"reversible (card, {config.f_max_iter} coupled steps)"
    assert stats.trace.numel() == config.f_max_iter and stats.nfe == 2 * config.f_max_iter + 1
    (line,) = residual_figure({label: stats}, "t").axes[0].get_lines()[:1]
    assert len(line.get_xdata()) == config.f_max_iter
    legend = [t.get_text() for t in residual_figure({label: stats}, "t").axes[0].get_legend().get_texts()]
    assert legend[0].startswith(f"{label}: {stats.nfe} NFE") and config.f_solver not in legend[0]


def test_a_comparison_runs_deleted_files_read_as_words_not_paths():
    scratch = "/tmp/deqzoo-demo-abc123"
    text = f"camera (full, 256x256): PSNR 35.87 dB; rendered at 2x (512x512) to {scratch}/x_512x512.png"
    out = _without_scratch(text, scratch)
    assert scratch not in out and ".png" not in out and "/" not in out.split("to ", 1)[1]
    assert out.endswith("to a file this comparison run did not keep")


@pytest.mark.extended
def test_a_pipelines_solve_gets_its_residual_plot(tmp_path):
    """DEQ-DDIM (a diffusers pipeline, no set_deq) runs its card's solve only, and that solve is plotted."""
    rows, failures = run_demo(["deqzoo/ddim-digits-16"], tmp_path, progress=False)
    assert failures == [] and len(rows) == 1 and rows[0]["converged"] == "yes"
    assert (tmp_path / "ddim-digits-16_residuals.png").is_file()
