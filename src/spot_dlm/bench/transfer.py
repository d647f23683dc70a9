"""Drafter transfer: a drafter trained on one target, run unchanged on others, against one made for each.

Two measures per (target, drafter), both on the target's own trajectories and prompts:

- **next-commit accuracy** (``heldout_accuracy``): the order model's top-1 accuracy at predicting the position the
  target commits next, on the held-out tenth of the prompts of a trajectory folder (``spot-dlm collect`` /
  ``make-drafter``), split as ``train_drafter`` splits it, so a drafter trained on that folder is scored on exactly
  the prompts it never saw (and gets the figure its own metrics hold);
- **passes ratio** (``run_transfer``): ``bench`` rows (standard decoding and SPOT rows) run once per drafter folder on
  one loaded target, merged into one report whose rows name the drafter that ran (``row["drafter"]``).

``transfer_table`` turns such reports into one Markdown table. From the command line::

    spot-dlm transfer run --model M --drafter shipped=builtin --drafter own=DIR --shards DIR ... --json R.json
    spot-dlm transfer table docs/results/transfer/*.json
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from spot_dlm.bench.run import BenchConfig, run_bench
from spot_dlm.drafters.neighbours import BIGRAM_FILE
from spot_dlm.drafters.token_survival import SURVIVAL_FILE

ACCURACY_DEPTH = 8  # the depth make-drafter and collect log by default
ROW_PARTS = {  # a row's drafter switches -> the drafter folder's fitted part it runs (besides the order model)
    "token_survival": ("token survival", SURVIVAL_FILE),
    "neighbour_tokens": ("bigram neighbour tokens", BIGRAM_FILE),
}


def heldout_prompt_mask(prompt_ids: np.ndarray, seed: int = 0) -> np.ndarray:
    """bool per row: the row's prompt is in the held-out tenth, chosen as ``train_drafter`` chooses it."""
    prompts = np.unique(prompt_ids)
    held = np.random.default_rng(seed).choice(prompts, size=max(1, len(prompts) // 10), replace=False)
    return np.isin(prompt_ids, list(set(held)))


def heldout_accuracy(drafter_dir: str | Path, shard_dir: str | Path, max_depth: int = 8, seed: int = 0) -> dict:
    """The order model in ``drafter_dir`` scored on the held-out prompts of the trajectories in ``shard_dir``.

    Returns next-commit accuracy by depth (depth 1: the very next commit; depth d: the commit d steps after the
    stale pass), the same by logged temperature, the training-free stale-confidence guess's accuracy on the same
    examples, the number of examples and the model's parameters."""
    import torch

    from spot_dlm.drafters.folder import load_order_model
    from spot_dlm.train.collect import load_shards
    from spot_dlm.train.drafter import accuracy_by_depth, build_examples, by_temperature, naive_accuracy

    paths = sorted(Path(shard_dir).glob("shard_*.npz"))
    if not paths:
        raise FileNotFoundError(f"no trajectory shards (shard_*.npz) in {shard_dir}")
    model = load_order_model(Path(drafter_dir))
    data = load_shards(paths)
    held = build_examples(data, max_depth, np.flatnonzero(heldout_prompt_mask(data["prompt_id"], seed)))
    cum = np.concatenate([np.zeros((1, data["committed"].shape[1]), np.int32), np.cumsum(data["committed"], 0)])
    with torch.no_grad():
        accuracy = accuracy_by_depth(model, data, cum, held, max_depth)
        by_t = by_temperature(data, held, lambda ex: accuracy_by_depth(model, data, cum, ex, max_depth))
        naive = by_temperature(data, held, lambda ex: naive_accuracy(data, cum, ex, max_depth))
    return {
        "next_commit_accuracy_by_depth": accuracy,
        "next_commit_accuracy_by_temperature_and_depth": by_t,
        "stale_confidence_accuracy_by_temperature_and_depth": naive,
        "heldout_examples": int(len(held.row)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "shards": str(shard_dir),
    }


def row_drafter(name: str, row: str, folder: str | Path, parameters: int, vocabulary_shared: bool) -> str:
    """What drafted a SPOT row: the folder's name, the order model's size and the fitted parts the row used (a part
    runs when the row leaves it on and the folder holds it; the bigram table only on the vocabulary it counted)."""
    from spot_dlm.bench.rows import parse_row

    method, options = parse_row(row)
    if method != "spot":
        return name
    parts = [f"{name}: order model {parameters / 1e3:.0f}K"]
    for key, (label, file) in ROW_PARTS.items():
        held = (Path(folder) / file).is_file() and (vocabulary_shared or key != "neighbour_tokens")
        if options.get(key, True) and held:
            parts.append(label)
    return " + ".join(parts)


def run_transfer(
    target,
    codec,
    bench: BenchConfig,
    drafters: dict[str, str],
    shards: str | None = None,
    target_name: str | None = None,
    trained_on: dict[str, str] | None = None,
    progress: bool = True,
) -> dict:
    """``bench`` once per drafter folder (``drafters``: name -> folder) on one loaded target, merged into one report.

    The report holds the standard row once and every other row once per drafter, each with ``drafter`` (what ran,
    see ``row_drafter``) and ``drafter_name``; ``transfer`` records the target, each drafter's folder, parameters,
    what it was trained on and, given ``shards`` (the target's trajectories), its held-out next-commit accuracy."""
    from dataclasses import replace

    from spot_dlm.drafters.folder import default_drafter_dir

    builtin = str(default_drafter_dir())
    folders = {name: builtin if folder == "builtin" else str(folder) for name, folder in drafters.items()}
    vocabulary_shared = int(target.vocab_size) == _builtin_vocab_size()
    configs, results, info = [], [], {}
    for name, folder in folders.items():
        # the shipped drafter runs as the default one: its bigram table is then left out (with a warning) on a target
        # of another vocabulary, where a folder given by name would be refused
        chosen = None if drafters[name] == "builtin" else folder
        report = run_bench(replace(bench, drafter=chosen), target, codec, progress=progress)
        accuracy = heldout_accuracy(folder, shards, ACCURACY_DEPTH) if shards else None
        parameters = accuracy["parameters"] if accuracy else _parameters(folder)
        configs.append(report["config"])
        for row in report["results"]:
            if row["method"] == "standard":
                if not any(r["method"] == "standard" and r["temperature"] == row["temperature"] for r in results):
                    results.append(row)
                continue
            results.append(
                {
                    **row,
                    "drafter_name": name,
                    "drafter": row_drafter(name, row["method"], folder, parameters, vocabulary_shared),
                }
            )
        info[name] = {
            "folder": drafters[name],
            "parameters": parameters,
            "trained_on": (trained_on or {}).get(name),
            "heldout_accuracy": accuracy,
        }
        machine, threads = report["machine"], report["torch_threads"]
    order = {name: i for i, name in enumerate(folders)}
    results.sort(key=lambda r: (r["temperature"], r["method"] != "standard", order.get(r.get("drafter_name"), -1)))
    return {
        "config": configs,
        "machine": machine,
        "torch_threads": threads,
        "transfer": {
            "target": target_name or bench.model or "builtin",
            "target_vocab_size": int(target.vocab_size),
            "vocabulary_shared_with_builtin": vocabulary_shared,
            "drafters": info,
        },
        "results": results,
    }


def _builtin_vocab_size() -> int:
    from spot_dlm.models.builtin import builtin_dir

    return int(json.loads((builtin_dir() / "config.json").read_text())["vocab_size"])


def _parameters(folder: str) -> int:
    from spot_dlm.drafters.folder import load_order_model

    return sum(p.numel() for p in load_order_model(Path(folder)).parameters())


def _accuracy_cell(info: dict, temperature: float) -> str:
    accuracy = (info or {}).get("heldout_accuracy")
    if not accuracy:
        return "-"
    by_t = accuracy["next_commit_accuracy_by_temperature_and_depth"].get(f"{temperature:g}", {})
    value = by_t.get("1", by_t.get(1))
    return "-" if value is None else f"{value:.2f}"


def _stale_cell(transfer: dict, temperature: float) -> str:
    for info in transfer["drafters"].values():
        accuracy = info.get("heldout_accuracy")
        if accuracy:
            by_t = accuracy["stale_confidence_accuracy_by_temperature_and_depth"].get(f"{temperature:g}", {})
            value = by_t.get("1", by_t.get(1))
            return "-" if value is None else f"{value:.2f}"
    return "-"


def transfer_table(paths: list[Path]) -> str:
    """One Markdown table from transfer reports: per target, temperature and drafter row, the drafter's held-out
    next-commit accuracy (depth 1) on that target's trajectories, the stale-confidence guess's on the same examples,
    and the passes ratio (standard / method) at each budget ("-" where a report has no row at that budget)."""
    if not paths:
        raise ValueError("give one or more transfer reports")
    reports = [(path, json.loads(Path(path).read_text())) for path in sorted(Path(p) for p in paths)]
    for path, report in reports:
        if not isinstance(report, dict) or "transfer" not in report:
            raise ValueError(f"{path} is not a transfer report (no 'transfer' record)")
    budgets = sorted({r["budget"] for _, report in reports for r in report["results"] if r["budget"]})
    header = ["target", "T", "drafter", "what ran", "params", "next-commit acc.", "stale-conf. acc."]
    header += [f"passes x, budget {b}" for b in budgets]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for _, report in reports:
        transfer = report["transfer"]
        groups: dict[tuple, dict] = {}
        for row in report["results"]:
            if row["method"] != "standard":  # rows that ran the same parts (a folder without a fit) are one line
                key = (row["temperature"], row["drafter_name"], row["drafter"])
                groups.setdefault(key, {}).setdefault(row["budget"], row["passes_ratio_vs_standard"])
        for (temperature, name, drafter), ratios in groups.items():
            info = transfer["drafters"].get(name, {})
            cells = [
                transfer["target"],
                f"{temperature:g}",
                name,
                drafter.split(": ", 1)[-1],
                f"{info.get('parameters', 0) / 1e3:.0f}K",
                _accuracy_cell(info, temperature),
                _stale_cell(transfer, temperature),
                *(f"{ratios[b]:.2f}" if b in ratios else "-" for b in budgets),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
