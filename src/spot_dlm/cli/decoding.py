"""Subcommands that decode: demo, generate, check-model, calibrate."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spot_dlm.api import (
    DEFAULT_BLOCK_LENGTH,
    METHODS,
    ORDER_MODEL_SIZES,
    GenerateConfig,
    generate,
    is_speculative,
)
from spot_dlm.cli.options import (
    BUDGET_HELP,
    add_decoding_options,
    add_device_map_option,
    add_device_option,
    add_model_options,
    budget_value,
    csv,
    field_default,
    load_model,
)
from spot_dlm.models.families import FAMILIES


def add_parsers(sub) -> None:
    _add_demo(sub)
    _add_generate(sub)
    _add_check_model(sub)
    _add_calibrate(sub)


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="decode questions on the built-in target and picture the commit order")
    add_decoding_options(demo)
    demo.add_argument("--methods", default="standard", help="comma-separated methods to run side by side")
    demo.add_argument("--budget", type=budget_value, default=None, help=BUDGET_HELP)
    demo.add_argument("--questions", type=int, default=4, help="questions decoded (wall time over one is noise)")
    demo.add_argument("--plot", default="spot_demo_commit_order.png")
    demo.add_argument("--no-plot", action="store_true")
    demo.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from spot_dlm.demo import run_demo

    if args.device_map is not None:
        raise ValueError("demo loads its model on one --device; --device-map is for generate, bench, collect")
    run_demo(
        args.model,
        args.methods.split(","),
        args.block_length or DEFAULT_BLOCK_LENGTH,
        args.gen_length,
        args.temperature,
        args.seed,
        None if args.no_plot else Path(args.plot),
        device=args.device,
        budget=args.budget,
        n_questions=args.questions,
    )
    return 0


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate from prompts")
    gen.add_argument("--prompt", help="one question (the prompt template is applied)")
    gen.add_argument("--prompts-file", metavar="FILE", help="one prompt per line")
    gen.add_argument(
        "--method",
        default=field_default(GenerateConfig, "method"),
        metavar="METHOD",
        help=f"{', '.join(sorted(METHODS))} (default: standard)",
    )
    gen.add_argument("--budget", type=budget_value, default=None, help=BUDGET_HELP)
    gen.add_argument("--drafter", default=None, metavar="DIR", help="drafter folder (default: the shipped one)")
    gen.add_argument("--tau", type=float, default=field_default(GenerateConfig, "tau"), help="threshold rules' tau")
    add_decoding_options(gen)
    gen.add_argument("--steps", type=int, default=None, help="families: SDAR passes per block, LLaDA / Dream in all")
    gen.add_argument("--family-alg", default=None, help="Dream: entropy (default), maskgit_plus or topk_margin")
    gen.add_argument("--token-lm", action="store_true", help="re-rank drafted tokens by the folder's small LM too")
    gen.add_argument(
        "--order-model",
        choices=ORDER_MODEL_SIZES,
        default=field_default(GenerateConfig, "order_model"),
        help="spot's order model (auto: none at budget 2 on a CPU, else the folder's small one if any)",
    )
    gen.add_argument("--full-length", action="store_true", help="decode the whole gen length, not stop at EOS")
    gen.add_argument("--raw", action="store_true", help="do not apply the prompt template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt and line")
    gen.set_defaults(func=_generate)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts of --prompt or --prompts-file (exactly one of them)."""
    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompts-file FILE")
    if args.prompts_file is None:
        return [args.prompt]
    path = Path(args.prompts_file)
    if path.is_dir():
        raise ValueError(f"--prompts-file {path} is a folder; give a file with one prompt per line")
    if not path.is_file():
        raise ValueError(f"prompts file not found: {path}")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompt")
    return prompts


def _generate(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    config = GenerateConfig(
        method=args.method,
        block_length=args.block_length,
        gen_length=args.gen_length,
        temperature=args.temperature,
        seed=args.seed,
        tau=args.tau,
        budget=args.budget,
        token_lm=args.token_lm,
        order_model=args.order_model,
        drafter=args.drafter,
        stop_at_eos=not args.full_length,
        apply_template=not args.raw,
        steps=args.steps,
        family_alg=args.family_alg,
    )
    target, codec = load_model(args)
    if config.budget is None and is_speculative(config.method):
        from spot_dlm.budget import choose_budget

        print(choose_budget(target, config.temperature).describe(), file=sys.stderr)
    for gen in generate(prompts, config, target, codec, progress=not args.json and len(prompts) > 1):
        if args.json:
            record = {
                "method": gen.method,
                "prompt": gen.prompt,
                "token_ids": gen.token_ids,
                "text": gen.text,
                "target_passes": gen.target_passes,
                **{k: v for k, v in gen.stats.items() if k != "target_passes"},
            }
            print(json.dumps(record))
        else:
            print(
                f"{gen.text}\n[{gen.method}: {len(gen.token_ids)} tokens, {gen.target_passes} target passes, "
                f"{gen.stats['wall_seconds']:.2f} s]"
            )
    return 0


def _add_check_model(sub) -> None:
    check = sub.add_parser(
        "check-model", help="decode a few prompts with a checkpoint's standard loop and SPOT: exactness, flips, speed"
    )
    check.add_argument("folder", help="a transformers checkpoint folder (SDAR, LLaDA, Dream, Fast-dLLM v2, generic)")
    check.add_argument(
        "--trust-remote-code", action="store_true", help="run the folder's own modeling code (every family needs it)"
    )
    check.add_argument("--family", choices=tuple(FAMILIES), default=None, help="default: detected from config.json")
    check.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"), default="bfloat16")
    check.add_argument("--n-prompts", type=int, default=3)
    check.add_argument("--gen-length", type=int, default=64)
    check.add_argument("--budget", type=int, default=8, help="SPOT's draft nodes per pass")
    check.add_argument("--json", default=None, help="also write the report to this file")
    add_device_option(check)
    add_device_map_option(check)
    check.set_defaults(func=_check_model)


def _add_calibrate(sub) -> None:
    cal = sub.add_parser("calibrate", help="measure the fastest SPOT budget here for a model (budget auto uses it)")
    add_model_options(cal)
    cal.add_argument("--temperatures", type=csv(float), default=(0.0, 1.0))
    cal.add_argument("--n-prompts", type=int, default=4, help="GSM8K test questions decoded per setting")
    cal.add_argument("--gen-length", type=int, default=64)
    cal.add_argument("--budgets", type=csv(int), default=(2, 3, 4, 8, 16), help="candidate budgets")
    cal.set_defaults(func=_calibrate)


def _check_model(args: argparse.Namespace) -> int:
    import torch

    from spot_dlm.check_model import check_model, format_report, write_report

    if args.json is not None and Path(args.json).is_dir():
        raise ValueError(f"--json {args.json} is a folder; give a file name")
    options = {"trust_remote_code": args.trust_remote_code, "family": args.family, "device_map": args.device_map}
    dtype = getattr(torch, args.dtype)
    report = check_model(args.folder, args.device, dtype, args.n_prompts, args.gen_length, args.budget, options)
    print(format_report(report))
    if args.json is not None:
        write_report(report, args.json)
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from spot_dlm.budget import cache_path, calibrate
    from spot_dlm.train.data import load_gsm8k

    if args.n_prompts < 1 or args.gen_length < 1 or any(b < 1 for b in args.budgets):
        raise ValueError("calibrate needs --n-prompts >= 1, --gen-length >= 1 and budgets >= 1")
    target, codec = load_model(args)
    prompts = [item["question"] for item in load_gsm8k("test")[-args.n_prompts :]]  # apart from the bench's first ones
    for temperature in args.temperatures:
        with tqdm(total=len(prompts), desc=f"calibrate T={temperature:g}") as bar:
            table = calibrate(
                target, codec, prompts, temperature, args.gen_length, tuple(args.budgets), lambda i, n: bar.update(1)
            )
        ratios = ", ".join(f"{b}: {r:.2f}x" for b, r in sorted(table.items()))
        print(
            f"T={temperature:g}: tokens/s vs standard by budget {ratios} -> budget auto = {max(table, key=table.get)}"
        )
    print(f"cached in {cache_path()}")
    return 0
