"""Calibrating the Spiffy-style static draft graph from logged trajectories.

For each logged step ``i`` and depth ``d``, the commit of step ``i + d`` has a rank among the positions still
masked on the branch, ordered by the stale coupled confidence for that step. The rank paths ``(r_1, ..., r_d)``
seen most often form the static graph; a budget of N nodes keeps the N - 1 most frequent (prefix-closed).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np


def rank_path_counts(data: dict[str, np.ndarray], max_depth: int) -> Counter:
    """Count rank paths over all logged steps (one-commit trajectories)."""
    block, committed, masked, coupled = data["block_id"], data["committed"], data["masked"], data["coupled"]
    counts: Counter = Counter()
    n_rows = len(block)
    for i in range(n_rows):
        branch = committed[i].copy()
        path: tuple[int, ...] = ()
        for d in range(1, max_depth + 1):
            j = i + d
            if j >= n_rows or block[j] != block[i] or committed[j].sum() != 1:
                break
            allowed = masked[i] & ~branch
            conf = np.where(allowed, coupled[i, d - 1].astype(np.float64), -np.inf)
            order = np.argsort(-conf, kind="stable")
            target = int(committed[j].argmax())
            path = path + (int(np.flatnonzero(order == target)[0]),)
            counts[path] += 1
            branch |= committed[j]
    return counts


def select_rank_paths(counts: Counter, budget: int) -> list[tuple[int, ...]]:
    """The ``budget - 1`` most frequent paths, parents before children (prefix-closed by frequency)."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0]))
    chosen: list[tuple[int, ...]] = []
    taken = {()}
    for path, _ in ranked:
        if len(chosen) >= budget - 1:
            break
        if path[:-1] in taken:
            chosen.append(path)
            taken.add(path)
    return sorted(chosen, key=lambda p: (len(p), p))


def save_rank_counts(counts: Counter, path: Path) -> None:
    rows = [[list(k), v] for k, v in counts.most_common(4096)]
    Path(path).write_text(json.dumps(rows))


def load_rank_counts(path: Path) -> Counter:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file not found: {path}")
    try:
        return Counter({tuple(k): int(v) for k, v in json.loads(path.read_text())})
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"invalid calibration file {path}: {err}") from err
