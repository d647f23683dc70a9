"""``spot-dlm`` command line: demo | generate | prepare-data | train-target."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spot_dlm.api import (
    DRAFTER_FACTORIES,
    METHOD_RULES,
    NUMERICS,
    ORDER_MODEL_SIZES,
    GenerateConfig,
    generate,
    load_target,
)
from spot_dlm.drafters.order_model import OrderModelConfig
from spot_dlm.models.families import FAMILIES
from spot_dlm.tree import DEFAULT_DEPTH

FAMILY_NAMES = tuple(FAMILIES)


BUDGET_HELP = (
    "draft nodes scored per pass (speculative methods): a number, or auto (default: the budget measured fastest "
    "here by spot-dlm calibrate, else 2); 16 and more make fewest passes"
)


def _budget(text: str) -> int | None:
    """--budget: 'auto' (None) or a whole number."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a whole number or auto, got {text!r}") from None


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="'builtin' (default), a built-in checkpoint folder or a transformers folder"
    )
    parser.add_argument(
        "--shifted-logits", action="store_true", help="transformers models that predict token j at j - 1 (Dream)"
    )
    parser.add_argument("--mask-id", type=int, default=None, help="transformers models: the mask token id")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="transformers models: run the folder's own modeling code"
    )
    parser.add_argument(
        "--family",
        choices=FAMILY_NAMES,
        default=None,
        help="transformers models: the DLM family (default: detected from config.json; generic = a stock body)",
    )
    _add_device_option(parser)


def _add_device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto (CUDA when available)")


def _set_threads(threads: int) -> None:
    """torch's intra-op threads; 0 keeps torch's default."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def _add_decoding_options(parser: argparse.ArgumentParser, block_length: int | None = 32) -> None:
    _add_model_options(parser)
    parser.add_argument(
        "--block-length", type=int, default=block_length, help="default: the model's own (built-in: 32)"
    )
    parser.add_argument("--gen-length", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)


def _add_family_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="real families: SDAR passes per block, LLaDA / Dream passes in all (default: one commit per pass)",
    )
    parser.add_argument(
        "--numerics",
        choices=NUMERICS,
        default="authors",
        help="real families: decide each pass as the authors do (default) or by the project's float64 rule",
    )
    parser.add_argument(
        "--family-alg", default=None, help="Dream: confidence alg (entropy (default), maskgit_plus, topk_margin)"
    )


def _family_config(args: argparse.Namespace) -> dict:
    return {"steps": args.steps, "numerics": args.numerics, "family_alg": args.family_alg}


def _load_model(args: argparse.Namespace):
    hf_options = {
        "shifted_logits": args.shifted_logits,
        "mask_id": args.mask_id,
        "trust_remote_code": args.trust_remote_code,
        "family": args.family,
    }
    return load_target(args.model, hf_options=hf_options, device=args.device)


def _generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts_file is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompts-file FILE")
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if path.is_dir():
            raise ValueError(f"--prompts-file {path} is a folder; give a file with one prompt per line")
        if not path.is_file():
            raise ValueError(f"prompts file not found: {path}")
        prompts = [line for line in path.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"prompts file {path} holds no prompt")
    else:
        prompts = [args.prompt]
    config = GenerateConfig(
        method=args.method,
        block_length=args.block_length,
        gen_length=args.gen_length,
        temperature=args.temperature,
        seed=args.seed,
        tau=args.tau,
        budget=args.budget,
        depth=args.depth,
        token_lm=args.token_lm,
        order_model=args.order_model,
        drafter=args.drafter,
        stop_at_eos=not args.full_length,
        apply_template=not args.raw,
        **_family_config(args),
    )
    target, codec = _load_model(args)
    if config.budget is None and config.method in DRAFTER_FACTORIES:
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


def _calibrate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from spot_dlm.budget import cache_path, calibrate
    from spot_dlm.train.data import load_gsm8k

    if args.n_prompts < 1 or args.gen_length < 1 or any(b < 1 for b in args.budgets):
        raise ValueError("calibrate needs --n-prompts >= 1, --gen-length >= 1 and budgets >= 1")
    target, codec = _load_model(args)
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


def _make_drafter(args: argparse.Namespace) -> int:
    from spot_dlm.train.make_drafter import MakeDrafterConfig, make_drafter

    _set_threads(args.threads)
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
    target, codec = _load_model(args)
    summary = make_drafter(target, codec, config)
    print(json.dumps(summary, indent=2))
    check = summary["check"]
    if check["questions"]:
        print(
            f"drafter in {args.out}: {check['passes_ratio']:.2f}x fewer passes than standard on "
            f"{check['questions']} held-out questions (exact: {check['exact']}); use it with --drafter {args.out}"
        )
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


def _check_model(args: argparse.Namespace) -> int:
    import torch

    from spot_dlm.check_model import check_model, format_report, write_report

    if args.json is not None and Path(args.json).is_dir():
        raise ValueError(f"--json {args.json} is a folder; give a file name")
    options = {"trust_remote_code": args.trust_remote_code, "family": args.family}
    dtype = getattr(torch, args.dtype)
    report = check_model(args.folder, args.device, dtype, args.n_prompts, args.gen_length, args.budget, options)
    print(format_report(report))
    if args.json is not None:
        write_report(report, args.json)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from spot_dlm.demo import run_demo

    run_demo(
        args.model,
        args.methods.split(","),
        args.block_length,
        args.gen_length,
        args.temperature,
        args.seed,
        None if args.no_plot else Path(args.plot),
        device=args.device,
        budget=args.budget,
        n_questions=args.questions,
    )
    return 0


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


def _init_folder(name: str | None, option: str = "--init") -> Path | None:
    if name is None:
        return None
    if name == "builtin":
        from spot_dlm.models.builtin import builtin_dir

        return builtin_dir()
    path = Path(name)
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{option}: no checkpoint in {path}")
    return path


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
        init_from=_init_folder(args.init),
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        device=args.device,
        bf16=args.bf16,
        teacher=_init_folder(args.teacher, "--teacher"),
        keep_layers=args.keep_layers,
        force=args.force,
    )
    print(train_target(config))
    return 0


def _add_force_option(parser: argparse.ArgumentParser, replaces: str) -> None:
    parser.add_argument("--force", action="store_true", help=f"replace {replaces} (refused without it)")


def _csv(kind):
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def _worker(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/2, got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"worker I/N needs 0 <= I < N, got {text!r}")
    return index, count


def _check_reports(args: argparse.Namespace, plots_option: str = "--plots") -> None:
    """A command's --json report and plots: writable, and not replacing earlier ones without --force."""
    from spot_dlm.bench.plots import PLOT_FILES
    from spot_dlm.safety import check_new_file, check_output_folder

    check_new_file(args.json, args.force, "--json")
    check_output_folder(getattr(args, "plots", None), args.force, plots_option, PLOT_FILES)


def _bench(args: argparse.Namespace) -> int:
    from spot_dlm.bench.plots import plot_report
    from spot_dlm.bench.run import BenchConfig, format_table, reproduce_command, run_bench, write_report

    _check_reports(args)
    _set_threads(args.threads)
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
    )
    report = run_bench(bench)
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
    from spot_dlm.bench.plots import plot_report
    from spot_dlm.bench.run import format_table, merge_reports, write_report

    _check_reports(args)
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
    from spot_dlm.bench.run import write_report
    from spot_dlm.bench.verify_cost import (
        VerifyCostConfig,
        format_verify_table,
        measure_verify_cost,
        plot_verify_cost,
    )
    from spot_dlm.safety import check_new_file

    check_new_file(args.json, args.force, "--json")
    check_new_file(args.plot, args.force, "--plot")
    _set_threads(args.threads)
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


def _collect(args: argparse.Namespace) -> int:
    from spot_dlm.train.collect import CollectConfig, collect

    _set_threads(args.threads)
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
        neighbours=None if args.neighbours is None else str(_drafter_folder(args.neighbours)),
    )
    target, codec = _load_model(args)
    shards = collect(target, codec, config)
    print(f"{len(shards)} shards in {args.out}")
    return 0


def _fit_bigram(args: argparse.Namespace) -> int:
    import numpy as np

    from spot_dlm.drafters.neighbours import BIGRAM_FILE, NEIGHBOUR_FIT_FILE, BigramTable, save_bigram
    from spot_dlm.drafters.token_lm import TOKEN_LM_FIT_FILE
    from spot_dlm.safety import check_output_folder
    from spot_dlm.train.data import build_token_stream, train_items

    out = _drafter_folder(args.out)
    if not out.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {out}")
    if args.n_symbolic < 0:
        raise ValueError(f"--n-symbolic must be >= 0, got {args.n_symbolic}")
    check_output_folder(out, args.force, "--out", (BIGRAM_FILE,))
    target, codec = _load_model(args)
    stream = build_token_stream(train_items(args.n_symbolic), codec, dtype=np.int64)
    table = BigramTable.from_stream(stream, target.vocab_size)  # the model's vocabulary (may exceed the tokenizer's)
    source = {"corpus": "GSM8K train + gsm_symbolic (train seed)", "n_symbolic": args.n_symbolic}
    path = save_bigram(table, out, {**source, "tokens": int(len(stream))})
    print(f"{len(stream):,} tokens, {len(table.keys):,} distinct bigrams; wrote {path}")
    for name in (NEIGHBOUR_FIT_FILE, TOKEN_LM_FIT_FILE):  # fitted with the bigram replaced: stale now
        if (out / name).is_file():
            (out / name).unlink()
            print(f"removed {out / name} (fitted with the replaced bigram; spot-dlm fit-token-survival refits it)")
    return 0


def _fit_token_survival(args: argparse.Namespace) -> int:
    from spot_dlm.drafters.neighbours import NeighbourTokens, load_bigram, save_neighbour_fit
    from spot_dlm.drafters.token_survival import save_token_survival
    from spot_dlm.noise import check_seed
    from spot_dlm.safety import check_output_folder
    from spot_dlm.train.collect import collection_prompts
    from spot_dlm.train.token_survival import fit_token_survival, observe

    _set_threads(args.threads)
    out = _drafter_folder(args.out)
    if not out.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {out}")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0 (the sampled kind), got {args.temperature}")
    if args.n_prompts < 1:
        raise ValueError(f"--n-prompts must be >= 1, got {args.n_prompts}")
    check_seed(args.seed)
    check_output_folder(out, args.force, "--out", _survival_fits(out, args.token_lm is not None))
    target, codec = _load_model(args)
    prompts = collection_prompts(args.n_prompts, args.seed)
    shape = {"block_length": args.block_length, "gen_length": args.gen_length}
    bigram = load_bigram(out, target.vocab_size)
    corrector = None if bigram is None else NeighbourTokens(bigram, 1.0, 1.0)  # weights fitted below
    if args.token_lm is not None:  # fitted together with the bigram when the folder has one
        return _fit_token_lm(args, target, codec, prompts, shape, out, corrector)
    greedy = observe(target, codec, prompts, 0.0, args.seed, corrector=corrector, **shape)
    sampled = observe(target, codec, prompts, args.temperature, args.seed, corrector=corrector, **shape)
    survival = fit_token_survival(greedy, sampled)
    print("guesses     kind     staleness  commits  top guess kept  scale  outside")
    _print_survival("stale", survival, greedy, sampled, lambda obs, d: obs.arrays(d)[1])
    print(f"wrote {save_token_survival(survival, out)}")
    if bigram is not None:
        weights, corrected = _fit_correction("neighbour", greedy, sampled)
        print(f"wrote {save_neighbour_fit(weights, corrected, out)}")
    return 0


def _survival_fits(out: Path, token_lm: bool) -> tuple[str, ...]:
    """What fit-token-survival writes into a drafter folder: the token LM and its fit, or the stale guesses'
    survival (and the neighbour fit where the folder has a bigram)."""
    from spot_dlm.drafters.neighbours import BIGRAM_FILE, NEIGHBOUR_FIT_FILE
    from spot_dlm.drafters.token_lm import TOKEN_LM_DIR, TOKEN_LM_FIT_FILE
    from spot_dlm.drafters.token_survival import SURVIVAL_FILE

    if token_lm:
        return TOKEN_LM_DIR, TOKEN_LM_FIT_FILE
    return (SURVIVAL_FILE, NEIGHBOUR_FIT_FILE) if (out / BIGRAM_FILE).is_file() else (SURVIVAL_FILE,)


def _fit_correction(name: str, greedy, sampled):
    """The corrector's (greedy, sampled) weights and the survival of its corrected guesses, printed."""
    from spot_dlm.train.token_survival import fit_neighbour_survival, fit_neighbour_weight

    weights = fit_neighbour_weight(greedy), fit_neighbour_weight(sampled)
    corrected = fit_neighbour_survival(greedy, sampled, weights)
    weight_of = {greedy.temperature: weights[0], sampled.temperature: weights[1]}
    _print_survival(name, corrected, greedy, sampled, lambda o, d: o.neighbour_arrays(weight_of[o.temperature], d)[1])
    print(f"{name} weights: greedy {weights[0]}, sampled {weights[1]}")
    return weights, corrected


def _fit_token_lm(args: argparse.Namespace, target, codec, prompts, shape, out: Path, bigram) -> int:
    """Install a small LM into the drafter folder and fit its correction, with the folder's bigram (``bigram``:
    its NeighbourTokens or None) as a second part; the other fits stay as they are."""
    from spot_dlm.drafters.token_lm import TokenLM, install_token_lm, load_small_lm, save_token_lm_fit
    from spot_dlm.train.token_survival import observe

    source = Path(args.token_lm)
    if not (source / "config.json").is_file():
        raise ValueError(f"token LM checkpoint not found: {source} (a folder of the built-in architecture)")
    small = load_small_lm(source, target, args.device)
    lm = TokenLM(small, 1.0, 1.0, window=args.token_lm_window, bigram=bigram)  # weights fitted below
    greedy = observe(target, codec, prompts, 0.0, args.seed, corrector=lm, **shape)
    sampled = observe(target, codec, prompts, args.temperature, args.seed, corrector=lm, **shape)
    print("guesses     kind     staleness  commits  top guess kept  scale  outside")
    weights, corrected = _fit_correction("token LM", greedy, sampled)
    print(f"installed {install_token_lm(source, out)}")
    print(f"wrote {save_token_lm_fit(weights, corrected, args.token_lm_window, out)}")
    return 0


def _print_survival(guesses: str, survival, greedy, sampled, ranks_of) -> None:
    """One line per (temperature kind, staleness): commits seen, top-guess survival, fitted bucket."""
    for kind, observations in (("greedy", greedy), ("sampled", sampled)):
        for staleness, bucket in enumerate(getattr(survival, kind), start=1):
            rank = ranks_of(observations, staleness)
            line = f"{guesses:10s}  {kind:8s} {staleness:9d} {len(rank):8d} {float((rank == 0).mean()):15.3f}"
            print(f"{line} {bucket.scale:6.3f} {bucket.outside:8.3f}")


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
        init=_drafter_folder(args.init),
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


def _drafter_folder(name: str | None) -> Path | None:
    """'builtin' -> the shipped order model's folder; a path as given; None stays None."""
    if name != "builtin":
        return None if name is None else Path(name)
    from spot_dlm.api import default_drafter_dir

    return default_drafter_dir()


def _evaluate_target(args: argparse.Namespace) -> int:
    import numpy as np

    from spot_dlm.safety import check_new_file, write_text_atomic
    from spot_dlm.train.data import heldout_items, train_questions
    from spot_dlm.train.evaluate import decode_report, heldout_nelbo

    _set_threads(args.threads)
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


class BenchDefaults:
    methods = ("standard", "spot", "stale", "chain", "calibrated", "oracle")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spot-dlm", description="Exact speculative decoding for diffusion LMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="decode a question on the built-in target and picture the commit order")
    _add_decoding_options(demo)
    demo.add_argument("--methods", default="standard", help="comma-separated methods to run side by side")
    demo.add_argument("--budget", type=_budget, default=None, help=BUDGET_HELP)
    demo.add_argument("--questions", type=int, default=4, help="questions decoded (wall time over one is noise)")
    demo.add_argument("--plot", default="spot_demo_commit_order.png")
    demo.add_argument("--no-plot", action="store_true")
    demo.set_defaults(func=_demo)

    gen = sub.add_parser("generate", help="generate from prompts")
    _add_decoding_options(gen, block_length=None)
    _add_family_options(gen)
    gen.add_argument("--prompt", help="one prompt (a question; the prompt template is applied)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--method", default="standard", help=f"one of: {', '.join(sorted(METHOD_RULES))}")
    gen.add_argument("--drafter", default=None, help="drafter folder for speculative methods (default: shipped)")
    gen.add_argument("--tau", type=float, default=0.9, help="confidence threshold (threshold, dynamic, spot-sets)")
    gen.add_argument("--budget", type=_budget, default=None, help=BUDGET_HELP)
    gen.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="maximum draft depth (speculative methods)")
    gen.add_argument(
        "--token-lm",
        action="store_true",
        help="spot, spot-sets: re-rank drafted tokens by the drafter folder's small LM too (fewer passes in deep "
        "trees; slower on a CPU)",
    )
    gen.add_argument(
        "--order-model",
        choices=ORDER_MODEL_SIZES,
        default="auto",
        help="spot: the paper-sized order model, the drafter folder's small one, none (the neighbour-corrected stale "
        "confidence ranks positions alone), or auto (on a CPU: none at budget 2, else the small one if any)",
    )
    gen.add_argument("--full-length", action="store_true", help="decode the whole gen length, not stop at EOS")
    gen.add_argument("--raw", action="store_true", help="do not apply the prompt template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt, one per line")
    gen.set_defaults(func=_generate)

    check = sub.add_parser(
        "check-model", help="decode a few prompts with a checkpoint's standard loop and SPOT: exactness, flips, speed"
    )
    check.add_argument("folder", help="a transformers checkpoint folder (SDAR, LLaDA, Dream, Fast-dLLM v2, generic)")
    check.add_argument(
        "--trust-remote-code", action="store_true", help="run the folder's own modeling code (every family needs it)"
    )
    check.add_argument("--family", choices=FAMILY_NAMES, default=None, help="default: detected from config.json")
    check.add_argument("--dtype", choices=("bfloat16", "float16", "float32", "float64"), default="bfloat16")
    check.add_argument("--n-prompts", type=int, default=3)
    check.add_argument("--gen-length", type=int, default=64)
    check.add_argument("--budget", type=int, default=8, help="SPOT's draft nodes per pass")
    check.add_argument("--json", default=None, help="also write the report to this file")
    _add_device_option(check)
    check.set_defaults(func=_check_model)

    cal = sub.add_parser("calibrate", help="measure the fastest SPOT budget here for a model (budget auto uses it)")
    _add_model_options(cal)
    cal.add_argument("--temperatures", type=_csv(float), default=(0.0, 1.0))
    cal.add_argument("--n-prompts", type=int, default=4, help="GSM8K test questions decoded per setting")
    cal.add_argument("--gen-length", type=int, default=64)
    cal.add_argument("--budgets", type=_csv(int), default=(2, 3, 4, 8, 16), help="candidate budgets")
    cal.set_defaults(func=_calibrate)

    mk = sub.add_parser(
        "make-drafter", help="a SPOT drafter for a model: collect, train, fit, check (resumable, one command)"
    )
    _add_model_options(mk)
    mk.add_argument("--out", required=True, help="the drafter folder (works with --drafter; resumed if there)")
    mk.add_argument("--n-prompts", type=int, default=200, help="prompts whose trajectories are collected")
    mk.add_argument("--prompts", default=None, help="a file of prompts, one per line (default: training questions)")
    mk.add_argument("--minutes", type=float, default=10.0, help="order-model training time")
    mk.add_argument("--gen-length", type=int, default=256)
    mk.add_argument("--block-length", type=int, default=None, help="default: the model's own")
    mk.add_argument("--survival-prompts", type=int, default=20)
    mk.add_argument("--check-prompts", type=int, default=3)
    mk.add_argument("--threads", type=int, default=1)
    mk.set_defaults(func=_make_drafter)

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

    rep = sub.add_parser("report", help="benchmark JSON reports as Markdown (docs/results.md is made by it)")
    rep.add_argument("files", nargs="+", help="benchmark JSON reports (spot-dlm bench --json)")
    rep.set_defaults(func=_report)

    prep = sub.add_parser("prepare-data", help="build the tokenizer and token streams for target training")
    prep.add_argument("--out", default="data_cache/corpus")
    prep.add_argument("--n-symbolic", type=int, default=100_000)
    prep.add_argument("--vocab-size", type=int, default=2048)
    prep.set_defaults(func=_prepare_data)

    train = sub.add_parser("train-target", help="train the built-in target (resumable)")
    train.add_argument("--out", default="runs/target")
    train.add_argument("--corpus", default="data_cache/corpus")
    train.add_argument("--phase", choices=("ar", "bd"), default="ar")
    train.add_argument("--minutes", type=float, default=60.0)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--batch-size", type=int, default=16)
    train.add_argument("--threads", type=int, default=2)
    train.add_argument("--snapshot-minutes", type=float, default=10.0)
    train.add_argument("--d-model", type=int, default=256, help="width of a new model (ignored when resuming)")
    train.add_argument("--n-layers", type=int, default=6, help="layers of a new model (ignored when resuming)")
    train.add_argument("--n-heads", type=int, default=4, help="heads of a new model (ignored when resuming)")
    train.add_argument("--bf16", action="store_true", help="bfloat16 autocast (on a GPU)")
    _add_device_option(train)
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
        type=_csv(int),
        default=None,
        help="start from these layers of --init only, e.g. 0,2,5 (a layer-dropped student to distil as a token LM)",
    )
    train.add_argument(
        "--force",
        action="store_true",
        help="replace a checkpoint in --out with a new model (or --init's) instead of resuming it",
    )
    train.set_defaults(func=_train_target)
    bench = sub.add_parser("bench", help="compare methods side by side (same prompts, same noise, one process)")
    bench.add_argument("--model", default=None)
    bench.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    _add_device_option(bench)
    bench.add_argument(
        "--methods", type=_csv(str), default=("standard", "spot", "stale", "chain", "calibrated", "oracle")
    )
    bench.add_argument("--budgets", type=_csv(int), default=(4, 8, 16, 32))
    bench.add_argument("--temperatures", type=_csv(float), default=(0.0, 1.0))
    bench.add_argument("--taus", type=_csv(float), default=(0.9,))
    bench.add_argument("--task", type=_csv(str), default=("gsm8k",), help="gsm8k, gsm_symbolic, humaneval")
    bench.add_argument("--n-prompts", type=int, default=50)
    bench.add_argument("--block-length", type=int, default=32)
    bench.add_argument("--gen-length", type=int, default=256)
    bench.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="maximum draft depth")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    bench.add_argument("--json", default=None, help="write the full report here")
    bench.add_argument("--plots", default=None, help="write PNG plots into this folder")
    _add_force_option(bench, "an existing --json report and --plots")
    bench.set_defaults(func=_bench)

    merge = sub.add_parser("bench-merge", help="merge bench JSON reports (e.g. one per process) into one")
    merge.add_argument("reports", nargs="+")
    merge.add_argument("--json", default=None)
    merge.add_argument("--plots", default=None)
    _add_force_option(merge, "an existing --json report and --plots")
    merge.set_defaults(func=_bench_merge)

    vc = sub.add_parser("verify-cost", help="time one verification pass over K draft nodes against one node")
    vc.add_argument("--shapes", type=_csv(str), default=("builtin",), help="builtin and/or dD-lN-hH-vV[-mM] shapes")
    vc.add_argument("--nodes", type=_csv(int), default=(1, 2, 4, 8, 16, 32))
    vc.add_argument("--prefix-length", type=int, default=256)
    vc.add_argument("--block-length", type=int, default=32)
    vc.add_argument("--repeats", type=int, default=10)
    vc.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    vc.add_argument("--scoring", default="batched", help="batched or packed")
    vc.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    vc.add_argument("--json", default=None)
    vc.add_argument("--plot", default=None, help="write a PNG of the cost curve here")
    _add_device_option(vc)
    _add_force_option(vc, "an existing --json report and --plot")
    vc.set_defaults(func=_verify_cost)

    col = sub.add_parser("collect", help="log standard-decoding trajectories on training prompts")
    _add_model_options(col)
    col.add_argument("--out", default="runs/trajectories")
    col.add_argument("--n-prompts", type=int, default=200)
    col.add_argument("--temperatures", type=_csv(float), default=(0.0, 1.0))
    col.add_argument("--block-length", type=int, default=32)
    col.add_argument("--gen-length", type=int, default=256)
    col.add_argument("--depth", type=int, default=8)
    col.add_argument("--method", default="standard")
    col.add_argument("--taus", type=_csv(float), default=(0.9,), help="threshold rules: taus to log")
    col.add_argument("--seed", type=int, default=1)
    col.add_argument("--threads", type=int, default=1)
    col.add_argument(
        "--worker", type=_worker, default=(0, 1), metavar="I/N", help="write shard I of every N (parallel processes)"
    )
    col.add_argument(
        "--neighbours",
        default=None,
        help="drafter folder (or builtin) whose bigram fit corrects the logged confidence (for --corrected-feature)",
    )
    col.set_defaults(func=_collect)

    ts = sub.add_parser(
        "fit-token-survival", help="fit how often stale coupled guesses survive (scores SPOT's drafted tokens)"
    )
    _add_model_options(ts)
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
    _add_force_option(ts, "the fits already in --out")
    ts.set_defaults(func=_fit_token_survival)

    bg = sub.add_parser(
        "fit-bigram", help="count the training corpus's bigrams (re-ranks SPOT's drafted tokens by fresh neighbours)"
    )
    _add_model_options(bg)
    bg.add_argument("--out", required=True, help="drafter folder for bigram.safetensors ('builtin': the shipped one)")
    bg.add_argument("--n-symbolic", type=int, default=100_000, help="gsm_symbolic training items besides GSM8K train")
    _add_force_option(bg, "a bigram fit already in --out (the fits made with it are removed)")
    bg.set_defaults(func=_fit_bigram)

    ev = sub.add_parser("evaluate-target", help="held-out NELBO, accuracy, well-formedness, stale agreement")
    ev.add_argument("--model", default=None)
    ev.add_argument("--n-prompts", type=int, default=50)
    ev.add_argument("--block-lengths", type=_csv(int), default=(16, 32))
    ev.add_argument("--gen-length", type=int, default=256)
    ev.add_argument("--heldout-tokens", default=None, help="heldout_tokens.npy from prepare-data (for NELBO)")
    ev.add_argument("--threads", type=int, default=0)
    ev.add_argument("--json", default=None)
    _add_force_option(ev, "an existing --json report")
    ev.set_defaults(func=_evaluate_target)

    tdr = sub.add_parser("train-drafter", help="train SPOT's order model on logged trajectories")
    tdr.add_argument("--shards", default="runs/trajectories")
    tdr.add_argument("--out", default="runs/drafter")
    tdr.add_argument("--minutes", type=float, default=10.0)
    tdr.add_argument("--depth", type=int, default=8)
    tdr.add_argument("--threads", type=int, default=1)
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
    _add_force_option(tdr, "a trained drafter in --out (the fits made for it are removed)")
    tdr.set_defaults(func=_train_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"spot-dlm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # long commands keep what they finished and say what in the message
        detail = f"; {stop}" if str(stop) else ""
        print(f"spot-dlm: interrupted{detail}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
