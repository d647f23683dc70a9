"""Subcommands that build a drafter for a target: make-drafter (all steps in one), and its steps collect,
train-drafter, fit-bigram, fit-token-survival."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spot_dlm.cli.options import (
    add_force_option,
    add_model_options,
    argument_default,
    csv,
    drafter_folder,
    field_default,
    load_model,
    set_threads,
    worker_value,
)


def add_parsers(sub) -> None:
    _add_make_drafter(sub)
    _add_collect(sub)
    _add_train_drafter(sub)
    _add_fit_bigram(sub)
    _add_fit_token_survival(sub)


def _add_make_drafter(sub) -> None:
    from spot_dlm.train.make_drafter import MakeDrafterConfig

    def default(name: str):
        return field_default(MakeDrafterConfig, name)

    mk = sub.add_parser(
        "make-drafter", help="a SPOT drafter for a model: collect, train, fit, check (resumable, one command)"
    )
    add_model_options(mk)
    mk.add_argument("--out", required=True, help="the drafter folder (works with --drafter; resumed if there)")
    mk.add_argument("--n-prompts", type=int, default=default("n_prompts"), help="prompts whose trajectories are kept")
    mk.add_argument("--prompts", default=None, help="a file of prompts, one per line (default: training questions)")
    mk.add_argument("--minutes", type=float, default=default("minutes"), help="order-model training time")
    mk.add_argument("--gen-length", type=int, default=default("gen_length"))
    mk.add_argument("--block-length", type=int, default=default("block_length"), help="default: the model's own")
    mk.add_argument("--survival-prompts", type=int, default=default("survival_prompts"))
    mk.add_argument("--check-prompts", type=int, default=default("check_prompts"))
    mk.add_argument("--threads", type=int, default=default("threads"))
    mk.set_defaults(func=_make_drafter)


def _add_collect(sub) -> None:
    from spot_dlm.train.collect import CollectConfig

    def default(name: str):
        return field_default(CollectConfig, name)

    col = sub.add_parser("collect", help="log standard-decoding trajectories on training prompts")
    add_model_options(col)
    col.add_argument("--out", default="runs/trajectories")
    col.add_argument("--n-prompts", type=int, default=default("n_prompts"))
    col.add_argument("--temperatures", type=csv(float), default=default("temperatures"))
    col.add_argument("--block-length", type=int, default=default("block_length"))
    col.add_argument("--gen-length", type=int, default=default("gen_length"))
    col.add_argument("--depth", type=int, default=default("depth"))
    col.add_argument("--method", default=default("method"))
    col.add_argument("--taus", type=csv(float), default=default("taus"), help="threshold rules: taus to log")
    col.add_argument("--seed", type=int, default=default("seed"))
    col.add_argument("--threads", type=int, default=1)
    col.add_argument(
        "--worker",
        type=worker_value,
        default=(0, 1),
        metavar="I/N",
        help="write shard I of every N (processes or machines; under torchrun the ranks share each shard)",
    )
    col.add_argument(
        "--neighbours",
        default=None,
        help="drafter folder (or builtin) whose bigram fit corrects the logged confidence (for --corrected-feature)",
    )
    col.set_defaults(func=_collect)


def _add_train_drafter(sub) -> None:
    from spot_dlm.drafters.order_net import OrderModelConfig
    from spot_dlm.train.drafter import train_drafter

    tdr = sub.add_parser("train-drafter", help="train SPOT's order model on logged trajectories")
    tdr.add_argument("--shards", default="runs/trajectories")
    tdr.add_argument("--out", default="runs/drafter")
    tdr.add_argument("--minutes", type=float, default=argument_default(train_drafter, "minutes"))
    tdr.add_argument("--depth", type=int, default=argument_default(train_drafter, "max_depth"))
    tdr.add_argument("--threads", type=int, default=argument_default(train_drafter, "threads"))
    tdr.add_argument("--sets", action="store_true", help="train the SPOT-Sets model (threshold trajectories)")
    tdr.add_argument(
        "--temperature-feature", action="store_true", help="give the model the sampling temperature as an input"
    )
    tdr.add_argument(
        "--previous-feature",
        action="store_true",
        help="give the model each position's top-1 probability one commit earlier (the confidence trend)",
    )
    tdr.add_argument(
        "--corrected-feature",
        action="store_true",
        help="give the model the neighbour-corrected confidence (shards collected with --neighbours)",
    )
    tdr.add_argument(
        "--init",
        default=None,
        help="continue from a trained drafter folder (or builtin); it may lack an input asked for here (zero weights)",
    )
    paper = OrderModelConfig()  # the paper's shape is the default
    tdr.add_argument("--d-model", type=int, default=paper.d_model, help="order model width (the paper's: 128)")
    tdr.add_argument("--n-layers", type=int, default=paper.n_layers, help="order model layers (the paper's: 3)")
    tdr.add_argument("--n-heads", type=int, default=paper.n_heads, help="attention heads; must divide --d-model")
    add_force_option(tdr, "a trained drafter in --out (the fits made for it are removed)")
    tdr.set_defaults(func=_train_drafter)


def _add_fit_token_survival(sub) -> None:
    ts = sub.add_parser(
        "fit-token-survival", help="fit how often stale coupled guesses survive (scores SPOT's drafted tokens)"
    )
    add_model_options(ts)
    ts.add_argument("--out", required=True, help="drafter folder for token_survival.json ('builtin': the shipped one)")
    ts.add_argument("--n-prompts", type=int, default=40, help="training prompts decoded per temperature")
    ts.add_argument("--temperature", type=float, default=1.0, help="the sampled temperature to fit (T > 0)")
    ts.add_argument("--block-length", type=int, default=32)
    ts.add_argument("--gen-length", type=int, default=256)
    ts.add_argument("--seed", type=int, default=1)
    ts.add_argument("--threads", type=int, default=1)
    ts.add_argument(
        "--token-lm",
        default=None,
        help="small block-diffusion LM folder (built-in architecture, the target's vocabulary): copy it into the "
        "drafter folder's token_lm/ and fit its correction of drafted tokens (the other fits stay as they are)",
    )
    ts.add_argument("--token-lm-window", type=int, default=256, help="clean tokens before the block the LM reads")
    add_force_option(ts, "the fits already in --out")
    ts.set_defaults(func=_fit_token_survival)


def _add_fit_bigram(sub) -> None:
    bg = sub.add_parser(
        "fit-bigram", help="count the training corpus's bigrams (re-ranks SPOT's drafted tokens by fresh neighbours)"
    )
    add_model_options(bg)
    bg.add_argument("--out", required=True, help="drafter folder for bigram.safetensors ('builtin': the shipped one)")
    bg.add_argument("--n-symbolic", type=int, default=100_000, help="gsm_symbolic training items besides GSM8K train")
    add_force_option(bg, "a bigram fit already in --out (the fits made with it are removed)")
    bg.set_defaults(func=_fit_bigram)


def _make_drafter(args: argparse.Namespace) -> int:
    from spot_dlm.train.make_drafter import MakeDrafterConfig, make_drafter

    set_threads(args.threads)
    config = MakeDrafterConfig(
        out_dir=Path(args.out),
        n_prompts=args.n_prompts,
        minutes=args.minutes,
        gen_length=args.gen_length,
        block_length=args.block_length,
        survival_prompts=args.survival_prompts,
        check_prompts=args.check_prompts,
        prompts_file=args.prompts,
        threads=args.threads,
    )
    target, codec = load_model(args)
    summary = make_drafter(target, codec, config)
    print(json.dumps(summary, indent=2))
    check = summary["check"]
    if check["questions"]:
        print(
            f"drafter in {args.out}: {check['passes_ratio']:.2f}x fewer passes than standard on "
            f"{check['questions']} held-out questions (exact: {check['exact']}); use it with --drafter {args.out}"
        )
    return 0


def _collect(args: argparse.Namespace) -> int:
    from spot_dlm.distributed import process_group
    from spot_dlm.train.collect import CollectConfig, collect

    set_threads(args.threads)
    config = CollectConfig(
        out_dir=Path(args.out),
        n_prompts=args.n_prompts,
        temperatures=args.temperatures,
        block_length=args.block_length,
        gen_length=args.gen_length,
        depth=args.depth,
        method=args.method,
        taus=args.taus,
        seed=args.seed,
        worker=args.worker[0],
        workers=args.worker[1],
        neighbours=None if args.neighbours is None else str(drafter_folder(args.neighbours)),
    )
    with process_group(args.device) as group:  # torchrun: each rank decodes its share, rank 0 writes the shards
        target, codec = load_model(args)
        try:
            shards = collect(target, codec, config)
        except KeyboardInterrupt:
            if group.is_main:
                raise
            return 130
    if group.is_main:
        print(f"{len(shards)} shards in {args.out}")
    return 0


def _train_drafter(args: argparse.Namespace) -> int:
    from spot_dlm.drafters.calibrated import rank_path_counts, save_rank_counts
    from spot_dlm.safety import write_atomic
    from spot_dlm.train.collect import load_shards
    from spot_dlm.train.drafter import CALIBRATION_FILE, train_drafter

    metrics = train_drafter(
        Path(args.shards),
        Path(args.out),
        minutes=args.minutes,
        max_depth=args.depth,
        threads=args.threads,
        sets=args.sets,
        temperature_feature=args.temperature_feature,
        previous_feature=args.previous_feature,
        corrected_feature=args.corrected_feature,
        init=drafter_folder(args.init),
        shape=(args.d_model, args.n_layers, args.n_heads),
        force=args.force,
    )
    if not args.sets:  # the Spiffy-style calibrated graph is built from the same one-commit trajectories
        counts = rank_path_counts(load_shards(sorted(Path(args.shards).glob("shard_*.npz"))), args.depth)
        write_atomic(Path(args.out) / CALIBRATION_FILE, lambda path: save_rank_counts(counts, path))
    print(json.dumps(metrics, indent=2))
    if metrics.get("interrupted"):
        raise KeyboardInterrupt(f"saved the drafter after {metrics['steps']} steps in {args.out}")
    return 0


def _fit_bigram(args: argparse.Namespace) -> int:
    from spot_dlm.drafters.neighbours import BIGRAM_FILE
    from spot_dlm.safety import check_output_folder
    from spot_dlm.train.fits import fit_bigram_into

    out = drafter_folder(args.out)
    if not out.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {out}")
    if args.n_symbolic < 0:
        raise ValueError(f"--n-symbolic must be >= 0, got {args.n_symbolic}")
    check_output_folder(out, args.force, "--out", (BIGRAM_FILE,))
    target, codec = load_model(args)
    fit_bigram_into(out, target, codec, args.n_symbolic)
    return 0


def _fit_token_survival(args: argparse.Namespace) -> int:
    from spot_dlm.noise import check_seed
    from spot_dlm.safety import check_output_folder
    from spot_dlm.train.collect import collection_prompts
    from spot_dlm.train.fits import fit_survival_into, fit_token_lm_into, survival_fits

    set_threads(args.threads)
    out = drafter_folder(args.out)
    if not out.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {out}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0 (the sampled kind), got {args.temperature}")
    if args.n_prompts < 1:
        raise ValueError(f"--n-prompts must be >= 1, got {args.n_prompts}")
    check_seed(args.seed)
    check_output_folder(out, args.force, "--out", survival_fits(out, args.token_lm is not None))
    target, codec = load_model(args)
    prompts = collection_prompts(args.n_prompts, args.seed)
    shape = {"block_length": args.block_length, "gen_length": args.gen_length}
    if args.token_lm is not None:
        source = Path(args.token_lm)
        window = args.token_lm_window
        fit_token_lm_into(out, source, target, codec, prompts, shape, args.temperature, args.seed, window, args.device)
    else:
        fit_survival_into(out, target, codec, prompts, shape, args.temperature, args.seed)
    return 0
