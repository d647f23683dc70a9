"""What a benchmark report says and where it goes: the table printed, the best budgets and how rounds ended, the
machine it ran on, the command that reproduces it, the JSON written whole, and reports of several processes merged.
"""

from __future__ import annotations

import json
import platform
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spot_dlm.safety import write_text_atomic

if TYPE_CHECKING:
    from spot_dlm.bench.run import BenchConfig


def machine_description(device: torch.device | None = None) -> str:
    """The CPU, its cores and torch; and where decoding ran (the GPU's name when it ran on one)."""
    import os

    cpu = platform.processor() or platform.machine()
    text = f"{platform.system()} {cpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    if device is not None and device.type == "cuda":
        return f"{text}, decoding on {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"{text}, decoding on the CPU"


def format_table(report: dict) -> str:
    header = (
        f"{'task':<13}{'T':>4}{'method':>12}{'budget':>7}{'tau':>5}{'passes':>8}{'tok/pass':>9}"
        f"{'acc.len':>8}{'tok/s':>8}{'pass x':>8}{'tok/s x':>8}{'exact':>6}{'accuracy':>9}"
    )
    lines = [header, "-" * len(header)]
    for r in report["results"]:
        accuracy = "-" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
        lines.append(
            f"{r['task']:<13}{r['temperature']:>4g}{r['method']:>12}{r['budget'] or '-':>7}{r['tau'] or '-':>5}"
            f"{r['target_passes']:>8}{r['tokens_per_pass']:>9.2f}{r['mean_accepted']:>8.2f}"
            f"{r['tokens_per_second']:>8.1f}{r['passes_ratio_vs_standard']:>8.2f}"
            f"{r['throughput_ratio_vs_standard']:>8.2f}{r['exact_match_vs_standard']:>6.2f}{accuracy:>9}"
        )
    return "\n".join(lines + best_budget_lines(report["results"]) + round_ending_lines(report["results"]))


def best_budgets(results: list[dict]) -> dict[tuple, dict]:
    """Per (task, temperature, method, tau) with a budget: the budget with the most tokens/s (measured cost)
    and the one with the fewest passes. -> {key: {"by_tokens_per_second": row, "by_passes": row}}"""
    groups: dict[tuple, list[dict]] = {}
    for row in results:
        if row["budget"] is not None:
            groups.setdefault((row["task"], row["temperature"], row["method"], row["tau"]), []).append(row)
    return {
        key: {
            "by_tokens_per_second": max(rows, key=lambda r: r["throughput_ratio_vs_standard"]),
            "by_passes": max(rows, key=lambda r: r["passes_ratio_vs_standard"]),
        }
        for key, rows in groups.items()
    }


def best_budget_lines(results: list[dict]) -> list[str]:
    lines = []
    for (task, temperature, method, tau), best in best_budgets(results).items():
        fast, few = best["by_tokens_per_second"], best["by_passes"]
        lines.append(
            f"best budget {task} T={temperature:g} {method}{'' if tau is None else f' tau={tau:g}'}: "
            f"by tokens/s {fast['budget']} ({fast['throughput_ratio_vs_standard']:.2f}x tok/s, "
            f"{fast['passes_ratio_vs_standard']:.2f}x passes); by passes {few['budget']} "
            f"({few['passes_ratio_vs_standard']:.2f}x passes, {few['throughput_ratio_vs_standard']:.2f}x tok/s)"
        )
    return lines


def round_ending_lines(results: list[dict]) -> list[str]:
    """Why the speculative rows' verify passes stopped, in shares of their rounds (reports that predate the count
    have none)."""
    from spot_dlm.decode import ROUND_ENDINGS

    lines = []
    for r in results:
        endings = r.get("round_endings") or {}
        total = sum(endings.values())
        if r["budget"] is None or not total:
            continue
        shares = ", ".join(f"{name} {endings.get(name, 0) / total:.0%}" for name in ROUND_ENDINGS)
        lines.append(f"rounds end {r['task']} T={r['temperature']:g} {r['method']} {r['budget']}: {shares} ({total})")
    return lines


def write_report(report: dict, json_path: Path | None) -> None:
    """Write the report as JSON (to a temporary name renamed into place: a report there stays whole until then)."""
    if json_path is not None:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(json_path), json.dumps(report, indent=2))


def reproduce_command(bench: BenchConfig) -> str:
    parts = [
        "spot-dlm bench",
        f"--methods {','.join(bench.methods)}",
        f"--budgets {','.join(map(str, bench.budgets))}",
        f"--temperatures {','.join(f'{t:g}' for t in bench.temperatures)}",
        f"--task {','.join(bench.tasks)}",
        f"--n-prompts {bench.n_prompts}",
        *([] if bench.block_length is None else [f"--block-length {bench.block_length}"]),
        f"--gen-length {bench.gen_length}",
        f"--taus {','.join(f'{t:g}' for t in bench.taus)}",
        f"--seed {bench.seed}",
        f"--depth {bench.depth}",
    ]
    if bench.model is not None:
        parts.append(f"--model {shlex.quote(str(bench.model))}")
    if bench.trust_remote_code:
        parts.append("--trust-remote-code")
    if bench.device_map is not None:
        parts.append(f"--device-map {shlex.quote(bench.device_map)}")
    if bench.drafter is not None:
        parts.append(f"--drafter {shlex.quote(str(bench.drafter))}")
    if bench.device != "cpu":
        parts.append(f"--device {bench.device}")
    return " ".join(parts) + f"  (at {time.strftime('%Y-%m-%d')})"


def merge_reports(reports: list[dict]) -> dict:
    """One report from runs split across processes (e.g. one per temperature); keeps every run's config."""
    if not reports:
        raise ValueError("nothing to merge")
    return {
        "config": [r["config"] for r in reports],
        "machine": reports[0]["machine"],
        "torch_threads": [r["torch_threads"] for r in reports],
        "reproduce": [r.get("reproduce") for r in reports],
        "results": [row for r in reports for row in r["results"]],
    }
