"""``spot-dlm report FILE...``: benchmark JSON reports as Markdown, so that numbers in prose come from the data.

``docs/results.md`` is made by ``spot-dlm report docs/results/*/*.json > docs/results.md``. Each report becomes a
section named by the question its path answers (``docs/results/cpu-tokens-per-second/budget2_gsm8k50.json``), with
the machine, the date and the command that made it, and one row per method: passes and tokens/s with their ratios to
standard decoding in the same run, the drafter that ran (its parameters) and its share of the wall time.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from types import SimpleNamespace

from spot_dlm.api import (
    GenerateConfig,
    is_speculative,
    runs_order_model,
    uses_small_order_model,
)
from spot_dlm.drafters.folder import DRAFTER_WEIGHTS_FILE, DrafterFolder

TABLE_HEADER = (
    "| task | T | method | budget | drafter | passes | passes x | tok/s | tok/s x | draft share | exact | accuracy |"
)
TRAINING_FREE = {"stale": "none (stale confidence)", "chain": "none (stale confidence chain)"}


@cache
def parameter_count(path: Path) -> int:
    """Parameters in a safetensors file (from its header; no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        names = handle.keys()  # the handle itself is not iterable
        return sum(_numel(handle.get_slice(name).get_shape()) for name in names)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _size(path: Path) -> str:
    count = parameter_count(path)
    return f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count / 1e3:.0f}K"


def drafter_description(method: str, budget: int | None, device: str) -> str:
    """What drafted for a benchmark row with the shipped drafters: the order model (and its size) or none, plus the
    token LM where the method asks for it."""
    from spot_dlm.bench.rows import parse_row

    base, options = parse_row(method)
    if budget is None or not is_speculative(base):
        return "-"
    if base in TRAINING_FREE or base == "stale-sets":
        return TRAINING_FREE.get(base, "none (stale confidence sets)")
    if base == "calibrated":
        return "rank-path table"
    target = SimpleNamespace(device=SimpleNamespace(type="cuda" if device.startswith("cuda") else "cpu"))
    folder = DrafterFolder.for_method(None, base, target.device)
    if base.startswith("spot-sets"):
        return f"sets model {_size(folder.path / DRAFTER_WEIGHTS_FILE)}"
    config = GenerateConfig(method=base, budget=budget, **options)
    if runs_order_model(config, target, corrected=config.neighbour_tokens):
        small = uses_small_order_model(config, target, folder)
        parts = [f"order model {_size((folder.small if small else folder.path) / DRAFTER_WEIGHTS_FILE)}"]
    else:
        parts = ["stale confidence (no order model)"]
    if config.token_lm:
        parts.append(f"token LM {_size(folder.fits / 'token_lm' / 'model.safetensors')}")
    return " + ".join(parts)


def _target_description(model: str | None) -> str:
    if model is None or model == "builtin":
        from spot_dlm.models.builtin import builtin_dir

        return f"the built-in target ({_size(builtin_dir() / 'model.safetensors')} parameters)"
    return str(model)


def _question(path: Path) -> str:
    """A report's title from its path: folder and file name, words spaced."""
    parts = [path.parent.name, path.stem] if path.parent.name not in ("", ".") else [path.stem]
    return " / ".join(part.replace("-", " ").replace("_", " ") for part in parts)


def _reproduce(report: dict) -> list[str]:
    value = report.get("reproduce")
    return [v for v in (value if isinstance(value, list) else [value]) if v]


def report_markdown(path: Path, report: dict) -> str:
    """One report as a Markdown section."""
    configs = report["config"] if isinstance(report["config"], list) else [report["config"]]
    device = configs[0].get("device", "cpu")
    lines = [f"## {_question(path)}", "", f"`{path}`: {report.get('machine', 'machine not recorded')}.", ""]
    lines += [f"    {command}" for command in _reproduce(report)]
    lines += ["", f"target: {_target_description(configs[0].get('model'))}", "", TABLE_HEADER, "|---" * 12 + "|"]
    for row in report["results"]:
        share = row["draft_seconds"] / row["wall_seconds"] if row.get("wall_seconds") else 0.0
        accuracy = "-" if row.get("accuracy") is None else f"{row['accuracy']:.2f}"
        # a row that records what drafted it (a drafter folder other than the shipped one) is described by that
        drafter = row.get("drafter") or drafter_description(row["method"], row["budget"], device)
        lines.append(
            f"| {row['task']} | {row['temperature']:g} | {row['method']} | {row['budget'] or '-'} | "
            f"{drafter} | {row['target_passes']} | "
            f"{row['passes_ratio_vs_standard']:.2f} | {row['tokens_per_second']:.1f} | "
            f"{row['throughput_ratio_vs_standard']:.2f} | {share:.0%} | {row['exact_match_vs_standard']:.2f} | "
            f"{accuracy} |"
        )
    return "\n".join(lines)


def load_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a readable benchmark report: {err}") from err
    if not isinstance(report, dict) or "results" not in report or "config" not in report:
        raise ValueError(f"{path} is not a benchmark report (no config and results)")
    return report


def results_markdown(paths: list[Path]) -> str:
    """The whole page: a header, then one section per report, in path order."""
    if not paths:
        raise ValueError("give one or more benchmark JSON reports")
    sections = [report_markdown(path, load_report(path)) for path in sorted(paths)]
    header = (
        "# Results\n\nGenerated by `spot-dlm report` from the JSON reports named in each section; do not edit by "
        "hand. `passes x` and `tok/s x` are ratios to standard decoding in the same run (same process, same prompts, "
        "interleaved); `exact` is the share of prompts whose tokens equal standard decoding's; `draft share` is the "
        "drafter's share of the wall time; the drafter column names what the shipped drafters run for that row "
        "with today's defaults, with their parameters.\n"
    )
    return "\n\n".join([header, *sections]) + "\n"
