"""Puzzle generators for the recursive reasoners: n x n Sudoku with unique solutions and mazes with
shortest-path labels, plus the stored held-out sets (pure Python / numpy, seeded, no downloads).

Sudoku: tokens 0 = blank, 1..n digits; labels: the solution's digits (classes 0..n, 0 never a target).
Boxes: 4x4 -> 2x2, 6x6 -> 2x3 (2 rows, 3 columns), 9x9 -> 3x3. A puzzle is made by filling a random grid
(randomised backtracking), then removing givens in random order while the solution stays unique (a solver
that counts solutions up to 2); `givens` is the difficulty knob: stop at that many givens, or None to go to
the fewest this removal order reaches (a minimal puzzle: no given can be removed).

Maze: an n x n grid (n odd) carved by a randomised depth-first search, with `extra_openings` walls knocked
out to create loops, start and goal at random open cells; tokens 1 = wall, 2 = open, 3 = start, 4 = goal;
labels 1 on the cells of the shortest start-goal path (BFS), 0 elsewhere; mazes whose shortest path is not
unique are redrawn, so the label is well defined.

Run ``python examples/reasoner/puzzles.py --write-heldout`` to (re)build the stored held-out sets.
"""

from __future__ import annotations

import argparse
import io
import random
from collections import deque
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent / "data"
BOXES = {4: (2, 2), 6: (2, 3), 9: (3, 3)}
# the stored evaluation sets: name -> (kind, size, count, seed); seeds far from any training seed.
# sudoku9_validation (its first 200 are the 9x9 probes' validation puzzles) is for choosing inference settings
# (select_halting.py), so that the held-out set is looked at once per choice.
HELDOUT = {"sudoku6_heldout": ("sudoku", 6, 1000, 10_000_006), "maze9_heldout": ("maze", 9, 500, 20_000_009),
           "sudoku9_heldout": ("sudoku", 9, 1000, 10_000_009),
           "sudoku9_validation": ("sudoku", 9, 1000, 30_000_009)}


# ------------------------------------------------------------------------------------------------- sudoku
class _Sudoku:
    """Bitmask backtracking over an n x n grid (0 = empty), most-constrained cell first."""

    def __init__(self, n: int):
        if n not in BOXES:
            raise ValueError(f"sudoku size must be one of {sorted(BOXES)}, got {n}")
        self.n = n
        self.br, self.bc = BOXES[n]
        self.full = (1 << (n + 1)) - 2  # bits 1..n

    def box(self, r: int, c: int) -> int:
        return (r // self.br) * (self.n // self.bc) + c // self.bc

    def solve(self, grid: list[int], limit: int = 2, rng: random.Random | None = None) -> tuple[int, list]:
        """(number of solutions found, capped at `limit`; the first solution). A `rng` randomises the order
        of candidate digits (used to fill an empty grid)."""
        n = self.n
        rows, cols, boxes = [0] * n, [0] * n, [0] * n
        empty = []
        for i, v in enumerate(grid):
            r, c = divmod(i, n)
            if v:
                bit = 1 << v
                if rows[r] & bit or cols[c] & bit or boxes[self.box(r, c)] & bit:
                    return 0, []
                rows[r] |= bit
                cols[c] |= bit
                boxes[self.box(r, c)] |= bit
            else:
                empty.append(i)
        cell_box = [self.box(*divmod(i, n)) for i in range(n * n)]
        g = list(grid)
        found = [0, None]

        def rec() -> bool:
            best, best_mask, best_count = -1, 0, 99
            for i in empty:
                if g[i]:
                    continue
                r, c = divmod(i, n)
                mask = self.full & ~(rows[r] | cols[c] | boxes[cell_box[i]])
                count = bin(mask).count("1")
                if count < best_count:
                    best, best_mask, best_count = i, mask, count
                    if count <= 1:
                        break
            if best < 0:
                found[0] += 1
                if found[1] is None:
                    found[1] = list(g)
                return found[0] >= limit
            if best_count == 0:
                return False
            digits = [d for d in range(1, n + 1) if best_mask >> d & 1]
            if rng is not None:
                rng.shuffle(digits)
            r, c = divmod(best, n)
            b = cell_box[best]
            for d in digits:
                bit = 1 << d
                g[best] = d
                rows[r] |= bit
                cols[c] |= bit
                boxes[b] |= bit
                stop = rec()
                rows[r] ^= bit
                cols[c] ^= bit
                boxes[b] ^= bit
                g[best] = 0
                if stop:
                    return True
            return False

        rec()
        return found[0], found[1] or []


def count_sudoku_solutions(grid, n: int, limit: int = 2) -> int:
    """Solutions of a puzzle (flat, 0 = blank), counted up to `limit`.

    >>> count_sudoku_solutions([1, 2, 3, 4, 3, 4, 1, 2, 2, 1, 4, 3, 4, 3, 2, 0], 4)
    1
    """
    return _Sudoku(n).solve([int(v) for v in grid], limit)[0]


def generate_sudoku(n: int, rng: random.Random, givens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(puzzle, solution), flat uint8 arrays of n*n, with a unique solution; `givens` as in the module doc.

    >>> p, s = generate_sudoku(4, random.Random(0))
    >>> count_sudoku_solutions(p, 4), bool(((p == 0) | (p == s)).all())
    (1, True)
    """
    solver = _Sudoku(n)
    _, solution = solver.solve([0] * (n * n), limit=1, rng=rng)
    puzzle = list(solution)
    order = list(range(n * n))
    rng.shuffle(order)
    left = n * n
    for i in order:
        if givens is not None and left <= givens:
            break
        keep = puzzle[i]
        puzzle[i] = 0
        if solver.solve(puzzle, limit=2)[0] != 1:
            puzzle[i] = keep
        else:
            left -= 1
    return np.array(puzzle, dtype=np.uint8), np.array(solution, dtype=np.uint8)


def augment_sudoku(puzzle: np.ndarray, solution: np.ndarray, n: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random validity-preserving transform of a puzzle and its solution: digit relabelling, rows permuted
    within bands and bands permuted, columns within stacks and stacks permuted (transposition too when the
    boxes are square). The solution stays unique."""
    br, bc = BOXES[n]
    digits = np.concatenate([[0], rng.permutation(n) + 1]).astype(np.uint8)
    bands = rng.permutation(n // br)
    rows = np.concatenate([b * br + rng.permutation(br) for b in bands])
    stacks = rng.permutation(n // bc)
    cols = np.concatenate([s * bc + rng.permutation(bc) for s in stacks])
    transpose = br == bc and rng.random() < 0.5  # one draw for both grids
    out = []
    for grid in (puzzle, solution):
        g = digits[grid.reshape(n, n)][rows][:, cols]
        out.append(np.ascontiguousarray(g.T if transpose else g).reshape(-1))
    return out[0], out[1]


# --------------------------------------------------------------------------------------------------- maze
WALL, OPEN, START, GOAL = 1, 2, 3, 4


def _bfs(grid: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Distances from start and the number of shortest paths to each cell (open cells only)."""
    n = grid.shape[0]
    dist = np.full(n * n, -1, dtype=np.int64)
    ways = np.zeros(n * n, dtype=np.int64)
    dist[start], ways[start] = 0, 1
    queue = deque([start])
    while queue:
        i = queue.popleft()
        r, c = divmod(i, n)
        for rr, cc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if 0 <= rr < n and 0 <= cc < n and grid[rr, cc] != WALL:
                j = rr * n + cc
                if dist[j] < 0:
                    dist[j] = dist[i] + 1
                    queue.append(j)
                if dist[j] == dist[i] + 1:
                    ways[j] = min(ways[j] + ways[i], 2)
    return dist, ways


def generate_maze(n: int, rng: random.Random, extra_openings: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, path labels), flat uint8 arrays of n*n, the shortest path unique (module doc).

    >>> tokens, path = generate_maze(7, random.Random(0))
    >>> int(path[tokens == 3][0]), int(path[tokens == 4][0]), int(path[tokens == 1].sum())
    (1, 1, 0)
    """
    if n < 5 or n % 2 == 0:
        raise ValueError(f"maze size must be odd and >= 5, got {n}")
    while True:
        grid = np.full((n, n), WALL, dtype=np.uint8)
        stack = [(1, 1)]
        grid[1, 1] = OPEN
        while stack:
            r, c = stack[-1]
            nbrs = [(r + dr, c + dc, dr, dc) for dr, dc in ((2, 0), (-2, 0), (0, 2), (0, -2))
                    if 0 < r + dr < n - 1 and 0 < c + dc < n - 1 and grid[r + dr, c + dc] == WALL]
            if not nbrs:
                stack.pop()
                continue
            rr, cc, dr, dc = rng.choice(nbrs)
            grid[r + dr // 2, c + dc // 2] = OPEN
            grid[rr, cc] = OPEN
            stack.append((rr, cc))
        inner = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1) if grid[r, c] == WALL]
        for r, c in rng.sample(inner, min(extra_openings, len(inner))):
            grid[r, c] = OPEN
        cells = [int(i) for i in np.flatnonzero(grid.reshape(-1) == OPEN)]
        start, goal = rng.sample(cells, 2)
        dist, ways = _bfs(grid, start)
        if dist[goal] < 2 or ways[goal] != 1:
            continue  # too short or not a unique shortest path: redraw
        back, _ = _bfs(grid, goal)
        on_path = (dist >= 0) & (back >= 0) & (dist + back == dist[goal])
        tokens = grid.reshape(-1).copy()
        tokens[start], tokens[goal] = START, GOAL
        return tokens, on_path.astype(np.uint8)


# --------------------------------------------------------------------------------------------- datasets
def make_set(kind: str, n: int, count: int, seed: int, givens: int | None = None) -> dict[str, np.ndarray]:
    """`count` puzzles drawn from `seed`: {"inputs": (count, n*n), "labels": (count, n*n)} uint8."""
    rng = random.Random(seed)
    pairs = [generate_sudoku(n, rng, givens) if kind == "sudoku" else generate_maze(n, rng)
             for _ in range(count)]
    return {"inputs": np.stack([p for p, _ in pairs]), "labels": np.stack([s for _, s in pairs])}


def load_heldout(name: str) -> dict[str, np.ndarray]:
    """A stored held-out set (data/<name>.npz): inputs, labels (uint8), and its recipe."""
    path = DATA / f"{name}.npz"
    if name not in HELDOUT:
        raise ValueError(f"unknown held-out set {name!r}; known: {sorted(HELDOUT)}")
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-heldout", action="store_true", help="build the missing data/*.npz")
    parser.add_argument("--replace", action="store_true", help="with --write-heldout: rebuild existing sets")
    args = parser.parse_args(argv)
    if args.write_heldout:
        from deqzoo.hub.saving import write_whole  # here: the generator itself runs without importing torch

        DATA.mkdir(exist_ok=True)
        for name, (kind, n, count, seed) in HELDOUT.items():
            path = DATA / f"{name}.npz"
            if path.exists() and not args.replace:
                print(name, "exists (--replace rebuilds it)")
                continue
            data = make_set(kind, n, count, seed)
            buffer = io.BytesIO()  # small (61 KB at 9x9): built in memory, then written whole or not at all
            np.savez_compressed(buffer, **data, kind=kind, size=n, seed=seed)
            write_whole(path, buffer.getvalue())
            givens = (data["inputs"] > 0).sum(1) if kind == "sudoku" else None
            print(name, data["inputs"].shape, "" if givens is None else
                  f"givens mean {givens.mean():.2f} min {givens.min()} max {givens.max()}")


if __name__ == "__main__":
    main()
