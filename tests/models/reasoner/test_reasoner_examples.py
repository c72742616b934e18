"""examples/reasoner: the puzzle generators (unique solutions, the givens knob, minimal held-out puzzles,
shortest-path mazes), the stored held-out sets, and the trainer's exact resume."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from deqzoo.models.reasoner import ReasonerConfig, ReasonerForGridClassification, grid_groups
from examples.reasoner import evaluate, puzzles, select_halting, train


@pytest.mark.parametrize("n", [4, 6])
def test_sudoku_puzzles_have_one_solution_and_the_givens_knob_works(n):
    rng = random.Random(7)
    for givens in (None, n * n // 2):
        for _ in range(5):
            p, s = puzzles.generate_sudoku(n, rng, givens)
            assert puzzles.count_sudoku_solutions(p, n, limit=3) == 1
            assert puzzles.count_sudoku_solutions(s, n) == 1 and set(s.tolist()) == set(range(1, n + 1))
            assert ((p == 0) | (p == s)).all()
            if givens is not None:
                assert int((p > 0).sum()) == givens


def test_sudoku_solver_counts_several_solutions():
    grid = np.zeros(16, dtype=np.uint8)
    assert puzzles.count_sudoku_solutions(grid, 4, limit=5) == 5
    bad = grid.copy()
    bad[0] = bad[1] = 1  # two 1s in a row
    assert puzzles.count_sudoku_solutions(bad, 4) == 0


@pytest.mark.parametrize("name", ["sudoku6_heldout", "sudoku9_heldout", "sudoku9_validation"])
def test_stored_sudoku_heldout_is_small_minimal_and_reproducible(name):
    path = puzzles.DATA / f"{name}.npz"
    assert path.stat().st_size <= 200_000
    data = puzzles.load_heldout(name)
    kind, n, count, seed = puzzles.HELDOUT[name]
    assert data["inputs"].shape == data["labels"].shape == (1000, n * n)
    assert len({bytes(r) for r in data["inputs"]}) == 1000
    again = puzzles.make_set(kind, n, 10, seed)  # the same generator stream: the first puzzles again
    assert np.array_equal(again["inputs"], data["inputs"][:10])
    for p, s in zip(data["inputs"][:15], data["labels"][:15]):
        assert puzzles.count_sudoku_solutions(p, n) == 1 and ((p == 0) | (p == s)).all()
        for i in np.flatnonzero(p):  # minimal: no given can go without losing uniqueness
            q = p.copy()
            q[i] = 0
            assert puzzles.count_sudoku_solutions(q, n) == 2


def test_validation_puzzles_are_not_held_out():
    held = {bytes(r) for r in puzzles.load_heldout("sudoku9_heldout")["labels"]}
    assert not held & {bytes(r) for r in puzzles.load_heldout("sudoku9_validation")["labels"]}


def test_write_heldout_builds_missing_sets_and_keeps_existing_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(puzzles, "DATA", tmp_path)
    monkeypatch.setattr(puzzles, "HELDOUT", {"a": ("sudoku", 4, 3, 1), "b": ("sudoku", 4, 3, 2)})
    (tmp_path / "a.npz").write_bytes(b"the user's own file")
    puzzles.main(["--write-heldout"])
    assert (tmp_path / "a.npz").read_bytes() == b"the user's own file"
    assert np.array_equal(puzzles.load_heldout("b")["inputs"], puzzles.make_set("sudoku", 4, 3, 2)["inputs"])
    puzzles.main(["--write-heldout", "--replace"])
    assert np.array_equal(puzzles.load_heldout("a")["inputs"], puzzles.make_set("sudoku", 4, 3, 1)["inputs"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "b.npz"]  # no .part left behind


def test_augmentation_keeps_puzzles_valid():
    rng = np.random.default_rng(0)
    for n in (6, 9):
        p, s = puzzles.generate_sudoku(n, random.Random(n), givens=n * n - 10)
        for _ in range(5):
            a, b = puzzles.augment_sudoku(p, s, n, rng)
            assert ((a == 0) | (a == b)).all() and puzzles.count_sudoku_solutions(b, n) == 1
            assert puzzles.count_sudoku_solutions(a, n) == 1


def test_maze_labels_are_the_unique_shortest_path():
    for seed in range(10):
        tokens, path = puzzles.generate_maze(9, random.Random(seed))
        grid = tokens.reshape(9, 9)
        start = int(np.flatnonzero(tokens == puzzles.START)[0])
        goal = int(np.flatnonzero(tokens == puzzles.GOAL)[0])
        dist, ways = puzzles._bfs(grid, start)
        assert ways[goal] == 1 and int(path.sum()) == dist[goal] + 1
        assert path[start] == path[goal] == 1 and not path[tokens == puzzles.WALL].any()
        on = set(np.flatnonzero(path).tolist())  # consecutive distances: a path, one cell per distance
        assert sorted(dist[list(on)].tolist()) == list(range(dist[goal] + 1))


ARGS = ["--task", "sudoku6", "--pool", "30", "--batch-size", "8", "--eval-every", "3", "--eval-size", "5",
        "--checkpoint-every", "3", "--no-progress", "--warmup", "2",
        "--config", json.dumps({"hidden_size": 16, "num_heads": 2, "h_cycles": 1, "l_cycles": 1,
                                "halt_max_steps": 2})]


def test_training_resumes_exactly(tmp_path):
    train.main(["--out", str(tmp_path / "a"), "--steps", "6", *ARGS])
    train.main(["--out", str(tmp_path / "b"), "--steps", "3", *ARGS])
    train.main(["--out", str(tmp_path / "b"), "--steps", "6", "--resume", *ARGS])
    a = ReasonerForGridClassification.from_pretrained(tmp_path / "a" / "checkpoint")
    b = ReasonerForGridClassification.from_pretrained(tmp_path / "b" / "checkpoint")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    log = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "eval" in r] == [3, 6]
    with pytest.raises(SystemExit, match="--resume"):
        train.main(["--out", str(tmp_path / "a"), "--steps", "6", *ARGS])
    # the twin: the same parameters, one cycle, one segment
    train.main(["--out", str(tmp_path / "t"), "--steps", "2", "--model", "twin", *ARGS])
    twin = ReasonerForGridClassification.from_pretrained(tmp_path / "t" / "checkpoint")
    assert twin.num_parameters() == a.num_parameters() and twin.config.halt_max_steps == 1
    report = evaluate.main([str(tmp_path / "a" / "checkpoint"), "--limit", "4", "--multiples", "1,2",
                            "--halting", "budget,stability"])
    assert [(r["multiple"], r["halting"]) for r in report["rows"]] == [(1, "budget"), (1, "stability"),
                                                                       (2, "budget"), (2, "stability")]
    assert report["rows"][2]["segments"] == 4.0


def test_cosine_schedule_warms_up_then_anneals_to_zero_at_the_last_step():
    args = train.parse(["--out", "x", "--lr", "1e-3", "--warmup", "10", "--steps", "110",
                        "--schedule", "cosine"])
    lrs = [train.learning_rate(args, step) for step in range(111)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3) and lrs[10] == pytest.approx(1e-3)
    assert lrs[60] == pytest.approx(5e-4) and lrs[110] == pytest.approx(0.0, abs=1e-18)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # non-increasing after warmup
    # with a CPU budget the cosine runs over process CPU time (ends annealed at any machine speed)
    timed = train.parse(["--out", "x", "--lr", "1e-3", "--warmup", "10", "--cpu-hours", "2",
                         "--schedule", "cosine"])
    assert train.learning_rate(timed, 5, cpu_s=3600.0) == pytest.approx(6e-4)  # warmup first
    assert train.learning_rate(timed, 500, cpu_s=3600.0) == pytest.approx(5e-4)
    assert train.learning_rate(timed, 500, cpu_s=7200.0) == pytest.approx(0.0, abs=1e-18)
    assert train.learning_rate(timed, 500, cpu_s=9000.0) == pytest.approx(0.0, abs=1e-18)
    constant = train.parse(["--out", "x", "--lr", "1e-3", "--warmup", "10", "--steps", "110"])
    assert train.learning_rate(constant, 110) == pytest.approx(1e-3)


def test_init_from_starts_a_new_run_at_those_weights_and_refuses_another_network(tmp_path):
    train.main(["--out", str(tmp_path / "a"), "--steps", "3", *ARGS])
    # zero steps: the new run's checkpoint is the weights it started from, not a fresh initialisation
    train.main(["--out", str(tmp_path / "b"), "--steps", "0", "--seed", "5",
                "--init-from", str(tmp_path / "a" / "checkpoint"), *ARGS])
    a = ReasonerForGridClassification.from_pretrained(tmp_path / "a" / "checkpoint")
    b = ReasonerForGridClassification.from_pretrained(tmp_path / "b" / "checkpoint")
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    with pytest.raises(SystemExit, match="is not this run's network"):
        train.main(["--out", str(tmp_path / "c"), "--steps", "1", "--model", "twin",
                    "--init-from", str(tmp_path / "a" / "checkpoint"), *ARGS])
    # another gradient mode is the same network: a DEQ stage warm-started by unrolled training
    stage2 = {**json.loads(ARGS[ARGS.index("--config") + 1]), "grad_mode": "deq", "deq": {"f_max_iter": 4}}
    train.main(["--out", str(tmp_path / "d"), "--steps", "0",
                "--init-from", str(tmp_path / "a" / "checkpoint"), *ARGS, "--config", json.dumps(stage2)])
    d = ReasonerForGridClassification.from_pretrained(tmp_path / "d" / "checkpoint")
    assert d.config.grad_mode == "deq" and d.config.deq["f_max_iter"] == 4
    for (name, p), q in zip(a.state_dict().items(), d.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", ["deqzoo.models.reasoner.configuration_reasoner",
                                  "deqzoo.models.reasoner.modeling_reasoner", "examples.reasoner.puzzles"])
def test_docstring_examples(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_training_with_the_group_mixer_gets_the_tasks_partitions(tmp_path):
    config = json.dumps({**json.loads(ARGS[-1]), "mixer": "groups"})
    train.main(["--out", str(tmp_path / "g"), "--steps", "2", *ARGS[:-2], "--config", config])
    model = ReasonerForGridClassification.from_pretrained(tmp_path / "g" / "checkpoint")
    assert model.config.token_groups == grid_groups(6, box=(2, 3))


def test_select_halting_checks_each_candidate_against_the_budget():
    cfg = ReasonerConfig(seq_len=16, vocab_size=5, num_labels=5, hidden_size=16, num_heads=2, h_cycles=1,
                         l_cycles=1, halt_max_steps=3)
    torch.manual_seed(0)
    model = ReasonerForGridClassification(cfg).eval()
    inputs = torch.randint(0, 5, (24, 16)).numpy().astype(np.uint8)
    labels = torch.randint(1, 5, (24, 16)).numpy().astype(np.uint8)
    cands = ["stability:1", "stability:3", "residual:1000"]
    report = select_halting.select(model, inputs, labels, cands, [1, 2])
    x = torch.from_numpy(inputs.astype(np.int64))
    for row in (r for r in report["rows"] if r["halting"] != "budget"):  # against direct calls
        budget = row["multiple"] * 3
        setting = {k: row[k] for k in ("halt_patience", "halt_tol") if k in row}
        halted = ReasonerForGridClassification(ReasonerConfig.from_dict({**cfg.to_dict(), **setting})).eval()
        halted.load_state_dict(model.state_dict())
        with torch.no_grad():
            full = model(x, num_segments=budget).logits.argmax(-1)
            out = halted(x, num_segments=budget, halting=row["halting"])
        early = out.steps < budget
        assert row["stopped_early"] == int(early.sum())
        assert row["early_same_as_budget"] == int((out.logits.argmax(-1)[early] == full[early]).all(1).sum())
    # random weights: stability:1 stops a puzzle whose answer then moves, stability:3 stops none early at 1x
    assert report["qualifies"] == {"stability:1": False, "stability:3": False, "residual:1000": False}
    assert report["choice"] is None
    with torch.no_grad():  # a token head of zeros: every answer is final after one segment
        model.lm_head.weight.zero_()
    report = select_halting.select(model, inputs, labels, cands, [1, 2])
    assert report["qualifies"] == {"stability:1": True, "stability:3": False, "residual:1000": True}
    assert report["choice"] == "residual:1000"  # 1 segment against stability:1's 2
    with pytest.raises(ValueError, match="stability:<patience>"):
        select_halting.main(["x", "--candidates", "act:1"])
