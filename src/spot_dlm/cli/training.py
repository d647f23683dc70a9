"""Subcommands that build the built-in target: prepare-data, train-target, evaluate-target."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spot_dlm.api import load_target
from spot_dlm.cli.options import (
    add_device_option,
    add_force_option,
    argument_default,
    checkpoint_folder,
    csv,
    field_default,
    set_threads,
)


def add_parsers(sub) -> None:
    _add_prepare_data(sub)
    _add_train_target(sub)
    _add_evaluate_target(sub)


def _add_prepare_data(sub) -> None:
    from spot_dlm.train.data import prepare_corpus

    prep = sub.add_parser("prepare-data", help="build the tokenizer and token streams for target training")
    prep.add_argument("--out", default="data_cache/corpus")
    prep.add_argument("--n-symbolic", type=int, default=argument_default(prepare_corpus, "n_symbolic"))
    prep.add_argument("--vocab-size", type=int, default=argument_default(prepare_corpus, "vocab_size"))
    prep.set_defaults(func=_prepare_data)


def _add_train_target(sub) -> None:
    from spot_dlm.train.target import PHASES, TrainConfig

    def default(name: str):
        return field_default(TrainConfig, name)

    train = sub.add_parser("train-target", help="train the built-in target (resumable)")
    train.add_argument("--out", default="runs/target")
    train.add_argument("--corpus", default="data_cache/corpus")
    train.add_argument("--phase", choices=PHASES, default=default("phase"))
    train.add_argument("--minutes", type=float, default=default("minutes"))
    train.add_argument("--lr", type=float, default=default("lr"))
    train.add_argument("--batch-size", type=int, default=default("batch_size"))
    train.add_argument("--threads", type=int, default=default("threads"))
    train.add_argument("--snapshot-minutes", type=float, default=default("snapshot_minutes"))
    train.add_argument("--d-model", type=int, default=default("d_model"), help="width of a new model")
    train.add_argument("--n-layers", type=int, default=default("n_layers"), help="layers of a new model")
    train.add_argument("--n-heads", type=int, default=default("n_heads"), help="heads of a new model")
    train.add_argument("--bf16", action="store_true", help="bfloat16 autocast (on a GPU)")
    add_device_option(train)
    train.add_argument(
        "--init", default=None, help="'builtin' or a checkpoint folder to resume from if --out is empty"
    )
    train.add_argument(
        "--teacher",
        default=None,
        help="bd phase: 'builtin' or a checkpoint folder whose distributions to distil (e.g. a small LM for token "
        "guesses)",
    )
    train.add_argument(
        "--keep-layers",
        type=csv(int),
        default=None,
        help="start from these layers of --init only, e.g. 0,2,5 (a layer-dropped student to distil as a token LM)",
    )
    train.add_argument(
        "--force",
        action="store_true",
        help="replace a checkpoint in --out with a new model (or --init's) instead of resuming it",
    )
    train.set_defaults(func=_train_target)


def _add_evaluate_target(sub) -> None:
    ev = sub.add_parser("evaluate-target", help="held-out NELBO, accuracy, well-formedness, stale agreement")
    ev.add_argument("--model", default=None)
    ev.add_argument("--n-prompts", type=int, default=50)
    ev.add_argument("--block-lengths", type=csv(int), default=(16, 32))
    ev.add_argument("--gen-length", type=int, default=256)
    ev.add_argument("--heldout-tokens", default=None, help="heldout_tokens.npy from prepare-data (for NELBO)")
    ev.add_argument("--threads", type=int, default=0)
    ev.add_argument("--json", default=None)
    add_force_option(ev, "an existing --json report")
    ev.set_defaults(func=_evaluate_target)


def _prepare_data(args: argparse.Namespace) -> int:
    from spot_dlm.safety import check_output_folder
    from spot_dlm.train.data import prepare_corpus

    if args.n_symbolic < 0:
        raise ValueError(f"--n-symbolic must be >= 0, got {args.n_symbolic}")
    if not 259 <= args.vocab_size <= 1 << 16:  # the 256 bytes and 3 special tokens; streams are 16-bit
        raise ValueError(f"--vocab-size must be in [259, 65536], got {args.vocab_size}")
    check_output_folder(args.out, False, "--out", ())
    print(prepare_corpus(Path(args.out), n_symbolic=args.n_symbolic, vocab_size=args.vocab_size))
    return 0


def _train_target(args: argparse.Namespace) -> int:
    from spot_dlm.train.target import TrainConfig, train_target

    config = TrainConfig(
        out_dir=Path(args.out),
        corpus_dir=Path(args.corpus),
        phase=args.phase,
        minutes=args.minutes,
        lr=args.lr,
        batch_size=args.batch_size,
        threads=args.threads,
        snapshot_minutes=args.snapshot_minutes,
        init_from=checkpoint_folder(args.init),
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        device=args.device,
        bf16=args.bf16,
        teacher=checkpoint_folder(args.teacher, "--teacher"),
        keep_layers=args.keep_layers,
        force=args.force,
    )
    print(train_target(config))
    return 0


def _evaluate_target(args: argparse.Namespace) -> int:
    import numpy as np

    from spot_dlm.safety import check_new_file, write_text_atomic
    from spot_dlm.train.data import heldout_items, train_questions
    from spot_dlm.train.evaluate import decode_report, heldout_nelbo

    set_threads(args.threads)
    if args.n_prompts < 0:
        raise ValueError(f"--n-prompts must be >= 0 (0: held-out NELBO only), got {args.n_prompts}")
    if args.heldout_tokens and not Path(args.heldout_tokens).is_file():
        raise FileNotFoundError(f"--heldout-tokens file not found: {args.heldout_tokens}")
    check_new_file(args.json, args.force, "--json")
    target, codec = load_target(args.model)
    report: dict = {"model": args.model or "builtin", "parameters": target.model.num_parameters()}
    if args.heldout_tokens:
        tokens = np.load(args.heldout_tokens)
        report["heldout_nelbo_per_token"] = {
            str(b): heldout_nelbo(target.model, tokens, b) for b in args.block_lengths
        }
    seen = train_questions(100_000) if args.n_prompts else frozenset()
    for source in ("gsm_symbolic", "gsm8k") if args.n_prompts else ():
        items = heldout_items(source, args.n_prompts, seen if source == "gsm_symbolic" else frozenset())
        report[source] = {str(b): decode_report(target, codec, items, b, args.gen_length) for b in args.block_lengths}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(args.json), text)
    return 0
