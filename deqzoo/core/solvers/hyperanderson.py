"""The HyperAnderson solver: Anderson's update with weights from a learned network (its step, which the
training unroll shares, is `deqzoo.core.hyper.step`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..hyper import BASES, FORMS, HyperNet, step
from ._contract import _empty_result, _sq_norms, _Tracker, bmm, compact, register_solver


@register_solver("hyperanderson")
@torch.no_grad()
def hyperanderson(g, x0, *, max_iter: int, tol: float, stop_mode: str = "rel", net: HyperNet | None = None,
                  m: int = 5, form: str = "anderson", base: str = "none", keep_steps: Iterable[int] = (),
                  div_factor: float = 1e6, halt=None):
    """HyperAnderson: Anderson's update over the last m + 1 iterates with α and β from the learned `net`.

    Same contract as every built-in solver (`._contract`): per-sample best iterate, per-sample stops
    (converged, non-finite, diverged, budget, ``halt`` rules), ``keep_steps``, compaction of the rows still
    iterating (the shared `_Tracker`). History buffers (m + 1 slots) are kept per row; the network sees the
    compressed residuals oldest first. ``stats.extra["beta"]`` is the mean β of each step (what the network
    chose).
    """
    if net is None or not callable(getattr(net, "compress", None)) or not callable(getattr(net, "mix", None)):
        raise TypeError(
            "solver 'hyperanderson' needs net=<a hypersolver network with compress(g) and mix(C)>"
            f", got {type(net).__name__}; attach one with model.set_hypersolver(...)"
        )
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"hyperanderson memory m must be an integer >= 0, got {m!r}")
    if form not in FORMS:
        raise ValueError(f"HyperAnderson form must be one of {FORMS}, got {form!r}")
    if base not in BASES:
        raise ValueError(f"HyperAnderson base must be one of {BASES}, got {base!r}")
    b, d = x0.shape
    if b == 0:
        return _empty_result(x0, "hyperanderson", tol, stop_mode)
    tracker = _Tracker(x0, max_iter, tol, stop_mode, "hyperanderson", keep_steps, div_factor, halt, g)
    cap = min(m + 1, max_iter)
    X = x0.new_empty(b, cap, d)
    G = x0.new_empty(b, cap, d)
    C: torch.Tensor | None = None  # (B, cap, c), allocated at the first compress (c is the network's)
    H = torch.zeros(b, cap, cap, dtype=torch.float64, device=x0.device) if base == "anderson" else None
    betas: list[torch.Tensor] = []
    x = x0.clone()
    for k in range(max_iter):
        fx = tracker.call(g, x)
        slot, n = k % cap, min(k + 1, cap)
        gx = torch.sub(fx, x, out=G[:, slot])
        keep = tracker.update_sq(x, *_sq_norms(gx, fx), fx)
        if tracker.done:
            break
        if keep is not None:
            x, gx, X, G, C, H = compact(keep, x, gx, X, G, C, H)
        rows = x.shape[0]
        X[:, slot] = x
        if H is not None:  # one Gram row per step, O(n·D), as Anderson
            row = bmm(gx.unsqueeze(1), G[:, :n].transpose(1, 2)).view(rows, n).double()
            H[:, slot, :n] = row
            H[:, :n, slot] = row
        feat = net.compress(gx).to(x.device)
        if C is None:
            C = feat.new_empty(rows, cap, feat.shape[-1])
        C[:, slot] = feat
        order = torch.tensor([(k - n + 1 + i) % cap for i in range(n)], device=x.device)
        Hn = None if H is None else H[:, :n, :n]
        x, _, beta = step(net, X[:, :n], G[:, :n], C[:, :n], order, form, Hn)
        betas.append(beta.mean())
    extra = {"beta": torch.stack(betas).double().cpu() if betas else torch.zeros(0, dtype=torch.float64)}
    return tracker.result(), tracker.stats(**extra)
