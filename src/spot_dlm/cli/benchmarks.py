"""Subcommands that measure and report: bench, bench-merge, verify-cost, project, report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spot_dlm.bench.run import BenchConfig
from spot_dlm.cli.options import (
    add_device_map_option,
    add_device_option,
    add_force_option,
    add_threads_option,
    check_reports,
    csv,
    field_default,
    set_threads,
)


def add_parsers(sub) -> None:
    _add_bench(sub)
    _add_bench_merge(sub)
    _add_verify_cost(sub)
    _add_project(sub)
    _add_report(sub)
    _add_transfer(sub)


def _add_bench(sub) -> None:
    bench = sub.add_parser(
        "bench", help="compare methods side by side (same prompts, same noise; under torchrun, prompts split by rank)"
    )
    bench.add_argument("--model", default=None)
    bench.add_argument("--trust-remote-code", action="store_true", help="run a transformers folder's own code")
    bench.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    add_device_option(bench)
    add_device_map_option(bench)
    bench.add_argument(
        "--methods",
        type=csv(str),
        default=field_default(BenchConfig, "methods"),
        help="comma-separated rows: METHOD or METHOD:key=value:..., e.g. spot:handoffs=off:order_model=small "
        "(keys: confidence_prior, token_survival, neighbour_tokens, neighbour_prior, token_lm, handoffs, order_model)",
    )
    bench.add_argument("--budgets", type=csv(int), default=field_default(BenchConfig, "budgets"))
    bench.add_argument("--temperatures", type=csv(float), default=field_default(BenchConfig, "temperatures"))
    bench.add_argument("--taus", type=csv(float), default=field_default(BenchConfig, "taus"))
    bench.add_argument(
        "--task", type=csv(str), default=field_default(BenchConfig, "tasks"), help="gsm8k, gsm_symbolic, humaneval"
    )
    bench.add_argument("--n-prompts", type=int, default=field_default(BenchConfig, "n_prompts"))
    bench.add_argument("--block-length", type=int, default=None, help="default: the model's own (built-in: 32)")
    bench.add_argument("--gen-length", type=int, default=field_default(BenchConfig, "gen_length"))
    bench.add_argument("--depth", type=int, default=field_default(BenchConfig, "depth"), help="maximum draft depth")
    bench.add_argument("--seed", type=int, default=field_default(BenchConfig, "seed"))
    add_threads_option(bench)
    bench.add_argument("--json", default=None, help="write the full report here")
    bench.add_argument("--plots", default=None, help="write PNG plots into this folder")
    add_force_option(bench, "an existing --json report and --plots")
    bench.set_defaults(func=_bench)


def _add_bench_merge(sub) -> None:
    merge = sub.add_parser("bench-merge", help="merge bench JSON reports (e.g. one per process) into one")
    merge.add_argument("reports", nargs="+")
    merge.add_argument("--json", default=None)
    merge.add_argument("--plots", default=None)
    add_force_option(merge, "an existing --json report and --plots")
    merge.set_defaults(func=_bench_merge)


def _add_verify_cost(sub) -> None:
    from spot_dlm.bench.verify_cost import VerifyCostConfig

    def default(name: str):
        return field_default(VerifyCostConfig, name)

    vc = sub.add_parser("verify-cost", help="time one verification pass over K draft nodes against one node")
    vc.add_argument("--shapes", type=csv(str), default=default("shapes"), help="builtin and/or dD-lN-hH-vV[-mM]")
    vc.add_argument("--nodes", type=csv(int), default=default("nodes"))
    vc.add_argument("--prefix-length", type=int, default=default("prefix_length"))
    vc.add_argument("--block-length", type=int, default=default("block_length"))
    vc.add_argument("--repeats", type=int, default=default("repeats"))
    vc.add_argument("--dtype", default=default("dtype"), help="float32, bfloat16 or float16")
    vc.add_argument("--scoring", default=default("scoring"), help="batched or packed")
    add_threads_option(vc)
    vc.add_argument("--json", default=None)
    vc.add_argument("--plot", default=None, help="write a PNG of the cost curve here")
    add_device_option(vc)
    add_force_option(vc, "an existing --json report and --plot")
    vc.set_defaults(func=_verify_cost)


def _add_project(sub) -> None:
    proj = sub.add_parser(
        "project", help="project SPOT's tokens/s at another target shape: bench acceptance x verify-cost pass cost"
    )
    proj.add_argument("--bench", required=True, help="a benchmark JSON report (spot-dlm bench --json)")
    proj.add_argument("--verify-cost", required=True, help="a verify-cost JSON report holding the target shape")
    proj.add_argument("--shape", default=None, help="which shape of the cost report (default: its only one)")
    proj.add_argument(
        "--drafter-ms",
        default=None,
        help="drafter time per round by budget, e.g. 2:1.7,4:3.9,8:7.7 (default: the bench's measured time)",
    )
    proj.set_defaults(func=_project)


def _add_report(sub) -> None:
    rep = sub.add_parser("report", help="benchmark JSON reports as Markdown (docs/results.md is made by it)")
    rep.add_argument("files", nargs="+", help="benchmark JSON reports (spot-dlm bench --json)")
    rep.set_defaults(func=_report)


def _bench(args: argparse.Namespace) -> int:
    from spot_dlm.bench.output import format_table, reproduce_command, write_report
    from spot_dlm.bench.plots import plot_report
    from spot_dlm.bench.run import BenchConfig, run_bench
    from spot_dlm.distributed import process_group

    check_reports(args)
    set_threads(args.threads)
    bench = BenchConfig(
        methods=args.methods,
        budgets=args.budgets,
        temperatures=args.temperatures,
        tasks=args.task,
        n_prompts=args.n_prompts,
        block_length=args.block_length,
        gen_length=args.gen_length,
        depth=args.depth,
        seed=args.seed,
        taus=args.taus,
        model=args.model,
        drafter=args.drafter,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        device_map=args.device_map,
    )
    with process_group(args.device) as group:  # torchrun: each rank decodes its share, rank 0 reports
        report = run_bench(bench)
    if not group.is_main:
        return 130 if report.get("interrupted") else 0
    if report.get("interrupted") and not report["results"]:
        raise KeyboardInterrupt("no row finished; nothing written")
    report["reproduce"] = reproduce_command(bench)
    print(f"# {report['machine']}, torch threads {report['torch_threads']}")
    print(format_table(report))
    print(f"# reproduce: {report['reproduce']}")
    write_report(report, Path(args.json) if args.json else None)
    if args.plots:
        for path in plot_report(report, Path(args.plots)):
            print(f"plot: {path}")
    if report.get("interrupted"):
        where = f", written to {args.json}" if args.json else ""
        raise KeyboardInterrupt(f"kept {len(report['results'])} row(s) of the prompts finished{where}")
    return 0


def _bench_merge(args: argparse.Namespace) -> int:
    from spot_dlm.bench.output import format_table, merge_reports, write_report
    from spot_dlm.bench.plots import plot_report

    check_reports(args)
    reports = []
    for name in args.reports:
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"bench report not found: {path}")
        reports.append(json.loads(path.read_text()))
    report = merge_reports(reports)
    print(format_table(report))
    write_report(report, Path(args.json) if args.json else None)
    if args.plots:
        for path in plot_report(report, Path(args.plots)):
            print(f"plot: {path}")
    return 0


def _verify_cost(args: argparse.Namespace) -> int:
    from spot_dlm.bench.output import write_report
    from spot_dlm.bench.verify_cost import (
        VerifyCostConfig,
        format_verify_table,
        measure_verify_cost,
        plot_verify_cost,
    )
    from spot_dlm.safety import check_new_file

    check_new_file(args.json, args.force, "--json")
    check_new_file(args.plot, args.force, "--plot")
    set_threads(args.threads)
    config = VerifyCostConfig(
        shapes=args.shapes,
        nodes=args.nodes,
        prefix_length=args.prefix_length,
        block_length=args.block_length,
        repeats=args.repeats,
        device=args.device,
        dtype=args.dtype,
        scoring=args.scoring,
    )
    report = measure_verify_cost(config)
    print(f"# {report['machine']}")
    print(format_verify_table(report))
    write_report(report, Path(args.json) if args.json else None)
    if args.plot:
        print(f"plot: {plot_verify_cost(report, Path(args.plot))}")
    return 0


def _project(args: argparse.Namespace) -> int:
    from spot_dlm.bench.projection import format_projection, project
    from spot_dlm.report import load_report

    drafter_ms = None
    if args.drafter_ms:
        try:
            drafter_ms = {int(b): float(ms) for b, ms in (item.split(":") for item in args.drafter_ms.split(","))}
        except ValueError:
            raise ValueError(
                f"--drafter-ms takes budget:ms pairs, e.g. 2:1.7,4:3.9; got {args.drafter_ms!r}"
            ) from None
    bench = load_report(Path(args.bench))
    cost_path = Path(args.verify_cost)
    try:
        cost = json.loads(cost_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{cost_path} is not a readable verify-cost report: {err}") from err
    if not isinstance(cost, dict) or "results" not in cost:
        raise ValueError(f"{cost_path} is not a verify-cost report (no results)")
    shape, rows = project(bench, cost, args.shape, drafter_ms)
    print(format_projection(shape, rows, bench.get("machine", "?"), cost.get("machine", "?")))
    return 0


def _report(args: argparse.Namespace) -> int:
    from spot_dlm.report import results_markdown

    print(results_markdown([Path(f) for f in args.files]), end="")
    return 0


def _add_transfer(sub) -> None:
    transfer = sub.add_parser(
        "transfer", help="drafters run unchanged on another target: held-out next-commit accuracy and bench rows"
    )
    commands = transfer.add_subparsers(dest="transfer_command", required=True)
    run = commands.add_parser("run", help="bench rows once per drafter on one target, and each one's accuracy")
    run.add_argument("--model", default="builtin")
    run.add_argument("--name", help="the target's name in the table (default: --model)")
    run.add_argument("--trust-remote-code", action="store_true")
    run.add_argument("--drafter", action="append", required=True, help="NAME=FOLDER ('builtin': the shipped one)")
    run.add_argument("--trained-on", action="append", default=[], help="NAME=TEXT: what that drafter was trained on")
    run.add_argument("--shards", help="the target's trajectory folder (held-out next-commit accuracy)")
    run.add_argument("--methods", type=csv(str), default=("standard", "spot"))
    run.add_argument("--budgets", type=csv(int), default=(2, 16, 64))
    run.add_argument("--temperatures", type=csv(float), default=(0.0, 1.0))
    run.add_argument("--n-prompts", type=int, default=8)
    run.add_argument("--block-length", type=int, default=32)
    run.add_argument("--gen-length", type=int, default=64)
    add_threads_option(run, default=1)
    run.add_argument("--json", required=True)
    add_force_option(run, "an existing --json report")
    run.set_defaults(func=_transfer_run)
    table = commands.add_parser("table", help="the Markdown table of transfer reports")
    table.add_argument("paths", nargs="+")
    table.set_defaults(func=_transfer_table)


def _transfer_table(args: argparse.Namespace) -> int:
    from spot_dlm.bench.transfer import transfer_table

    print(transfer_table([Path(p) for p in args.paths]), end="")
    return 0


def _pairs(items: list[str], option: str) -> dict[str, str]:
    """NAME=VALUE items -> {NAME: VALUE}."""
    pairs = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{option} takes NAME=VALUE, got {item!r}")
        pairs[name] = value
    return pairs


def _transfer_run(args: argparse.Namespace) -> int:
    from spot_dlm.api import load_target
    from spot_dlm.bench.output import reproduce_command, write_report
    from spot_dlm.bench.transfer import run_transfer, transfer_table
    from spot_dlm.safety import check_new_file

    check_new_file(args.json, args.force, "--json")
    drafters, trained_on = _pairs(args.drafter, "--drafter"), _pairs(args.trained_on, "--trained-on")
    set_threads(args.threads)
    bench = BenchConfig(
        methods=args.methods,
        budgets=args.budgets,
        temperatures=args.temperatures,
        n_prompts=args.n_prompts,
        block_length=args.block_length,
        gen_length=args.gen_length,
        model=args.model,
    )
    options = {"trust_remote_code": True} if args.trust_remote_code else None
    target, codec = load_target(args.model, hf_options=options)
    report = run_transfer(target, codec, bench, drafters, args.shards, args.name, trained_on)
    report["reproduce"] = [_transfer_command(args)]
    report["reproduce_bench"] = reproduce_command(bench)
    write_report(report, Path(args.json))
    print(transfer_table([Path(args.json)]), end="")
    return 0


def _transfer_command(args: argparse.Namespace) -> str:
    """The spot-dlm transfer run command that makes this report again."""
    import shlex

    words = ["spot-dlm", "transfer", "run", "--model", args.model]
    words += ["--name", args.name] if args.name else []
    words += ["--trust-remote-code"] if args.trust_remote_code else []
    for item in args.drafter:
        words += ["--drafter", item]
    for item in args.trained_on:
        words += ["--trained-on", item]
    words += ["--shards", args.shards] if args.shards else []
    words += ["--methods", ",".join(args.methods), "--budgets", ",".join(map(str, args.budgets))]
    words += ["--temperatures", ",".join(f"{t:g}" for t in args.temperatures), "--n-prompts", str(args.n_prompts)]
    words += ["--block-length", str(args.block_length), "--gen-length", str(args.gen_length)]
    words += ["--threads", str(args.threads), "--json", args.json]
    return shlex.join(words)
