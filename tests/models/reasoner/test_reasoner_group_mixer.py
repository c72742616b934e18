"""mixer "groups" (our addition to the reasoner family): the group means against a loop over positions,
its backward against finite differences, the grid partitions against the Sudoku solver's own boxes, I/O,
config errors and per-sample halting."""

from __future__ import annotations

import pytest
import torch

from deqzoo.configuration_utils import ConfigError
from deqzoo.models.reasoner import GroupMixer, ReasonerConfig, ReasonerForGridClassification, grid_groups
from examples.reasoner.puzzles import BOXES, _Sudoku

torch.set_num_threads(1)


def _config(n: int = 4, box=(2, 2), **kw) -> ReasonerConfig:
    return ReasonerConfig(**{"seq_len": n * n, "vocab_size": n + 1, "num_labels": n + 1, "hidden_size": 8,
                             "num_heads": 2, "num_layers": 1, "mixer": "groups", "pos_encodings": "learned",
                             "token_groups": grid_groups(n, box=box), "h_cycles": 1, "l_cycles": 1,
                             "halt_max_steps": 3, **kw})


def _reference_means(h: torch.Tensor, config: ReasonerConfig) -> torch.Tensor:
    """For each position and partition, the mean of the other members of its group (prefix positions are
    alone: zero), then the mean of all other positions; written as loops over positions."""
    b, n, d = h.shape
    p = config.num_prefix_tokens
    out = torch.zeros(b, n, (len(config.token_groups) + 1) * d, dtype=h.dtype)
    for i in range(n):
        for k, part in enumerate(config.token_groups):
            if i >= p:
                peers = [j for j in range(p, n) if j != i and part[j - p] == part[i - p]]
                if peers:
                    out[:, i, k * d:(k + 1) * d] = h[:, peers].mean(1)
        others = [j for j in range(n) if j != i]
        out[:, i, -d:] = h[:, others].mean(1)
    return out


@pytest.mark.parametrize("offset", [0.0, 1e3])  # 1e3: a common mode far above the spread (sum minus self)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_means_equal_a_loop_over_positions(dtype, offset):
    cfg = _config(6, box=(2, 3), num_prefix_tokens=2)
    torch.manual_seed(0)
    mixer = GroupMixer(cfg).to(dtype)
    h = offset + torch.randn(3, cfg.num_positions, cfg.hidden_size, dtype=torch.float64)
    want = mixer.proj(_reference_means(h, cfg).to(dtype))  # the means in float64, then rounded once
    with torch.no_grad():
        got = mixer(h.to(dtype))
        want = want.detach()
    eps = torch.finfo(dtype).eps
    # a sum of <= 38 terms, less the position's own, divided: a few ulps of the largest magnitude
    torch.testing.assert_close(got, want, rtol=0, atol=64 * eps * float(want.abs().max()) + 64 * eps)


def test_group_mixer_backward_matches_finite_differences():
    torch.manual_seed(1)
    mixer = GroupMixer(_config(4)).double()
    h = torch.randn(2, 17, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mixer(t), (h,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("n", sorted(BOXES))
def test_grid_groups_are_the_solvers_rows_columns_and_boxes(n):
    solver = _Sudoku(n)
    rows, cols, boxes = grid_groups(n, box=BOXES[n])
    for i in range(n * n):
        r, c = divmod(i, n)
        assert (rows[i], cols[i], boxes[i]) == (r, c, solver.box(r, c))
    assert all(sorted(set(g)) == list(range(n)) for g in (rows, cols, boxes))


def test_bad_groups_are_named():
    with pytest.raises(ConfigError, match="token_groups"):
        _config(token_groups=None)
    with pytest.raises(ConfigError, match="token_groups"):
        ReasonerConfig(seq_len=16, mixer="mlp", token_groups=grid_groups(4))
    with pytest.raises(ConfigError, match="partition 1 must hold seq_len \\(16\\)"):
        _config(token_groups=[list(range(16)), [0] * 15])
    with pytest.raises(ConfigError, match=r"in \[0, 16\), got 16 ids in \[-1"):
        _config(token_groups=[[-1] + [0] * 15])
    with pytest.raises(ValueError, match="box \\(2, 3\\) must divide"):
        grid_groups(4, box=(2, 3))


def test_save_load_round_trip_and_halting_per_sample(tmp_path):
    torch.manual_seed(2)
    model = ReasonerForGridClassification(_config()).double().eval()
    ids = torch.randint(0, 5, (4, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = ReasonerForGridClassification.from_pretrained(tmp_path).double().eval()
    assert loaded.config.token_groups == model.config.token_groups
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=0)
        # halting takes rows out of the batch: a row's answer does not depend on its batch-mates
        alone = loaded(ids[1:2], halting="stability").logits
        batch = loaded(ids, halting="stability").logits
    torch.testing.assert_close(batch[1:2], alone, rtol=1e-12, atol=1e-12)
