"""``spot-dlm make-drafter``: a SPOT drafter for the user's own model, in one resumable command.

Stages, each skipped when its output is already there (so an interrupted run picks up where it stopped):

1. collect the model's standard-decoding trajectories (``<out>/trajectories``: resumable shards);
2. train the order model on them (``<out>/drafter.safetensors``, held-out next-commit accuracy in its metrics) and
   the calibrated drafter's rank-path table;
3. fit how often a stale token guess survives (``<out>/token_survival.json``);
4. check: standard decoding and SPOT with this drafter on a few held-out GSM8K test questions, side by side.

The folder records the model it was made for (``make_drafter.json``: name, vocabulary, family) and refuses another.
It works with ``--drafter <out>``. Bigram and token-LM fits are left out: they need the model's training text.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

RECORD_FILE = "make_drafter.json"
TRAJECTORIES = "trajectories"


@dataclass(frozen=True)
class MakeDrafterConfig:
    out_dir: Path
    n_prompts: int = 200  # trajectories are collected on this many prompts, at T = 0 and T = 1
    minutes: float = 10.0  # order-model training
    gen_length: int = 256
    block_length: int | None = None  # None: the model's own
    depth: int = 8  # draft depths the order model learns
    survival_prompts: int = 20
    check_prompts: int = 3
    prompts_file: str | None = None  # one prompt per line, in place of the training questions
    threads: int = 1

    def __post_init__(self) -> None:
        if min(self.n_prompts, self.survival_prompts, self.check_prompts, self.gen_length, self.depth) < 1:
            raise ValueError("make-drafter needs prompts, survival prompts, check prompts, gen length and depth >= 1")
        if self.n_prompts < 2:
            raise ValueError("make-drafter needs at least 2 prompts (the order model holds some out)")
        if not 0 < self.minutes < float("inf"):
            raise ValueError(f"--minutes must be finite and > 0, got {self.minutes}")


def model_record(target) -> dict:
    """What a drafter folder records about the model it was made for."""
    family = getattr(getattr(target, "family", None), "name", "builtin")
    return {"model": getattr(target, "name", "target"), "vocab_size": int(target.vocab_size), "family": family}


def check_folder(out_dir: Path, record: dict) -> None:
    """A folder made for another model (vocabulary or family) is refused."""
    path = out_dir / RECORD_FILE
    if not path.is_file():
        return
    before = json.loads(path.read_text()).get("made_for", {})
    differs = [k for k in ("vocab_size", "family") if before.get(k) != record[k]]
    if differs:
        changes = ", ".join(f"{k} {before.get(k)!r} -> {record[k]!r}" for k in differs)
        raise ValueError(f"{out_dir} holds a drafter made for another model ({changes}); give a new --out")


def make_drafter(target, codec, config: MakeDrafterConfig, progress=print) -> dict:
    """Run the stages (see the module docstring); returns the summary also written to ``make_drafter.json``."""
    from spot_dlm.drafters.calibrated import rank_path_counts, save_rank_counts
    from spot_dlm.drafters.token_survival import SURVIVAL_FILE, save_token_survival
    from spot_dlm.safety import write_atomic, write_text_atomic
    from spot_dlm.train.collect import CollectConfig, collect, load_shards
    from spot_dlm.train.drafter import CALIBRATION_FILE, train_drafter
    from spot_dlm.train.token_survival import fit_token_survival, observe

    out = Path(config.out_dir)
    record = model_record(target)
    check_folder(out, record)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / RECORD_FILE, json.dumps({"made_for": record, "config": _jsonable(config)}, indent=2))
    shards_dir = out / TRAJECTORIES
    progress(f"make-drafter 1/4: trajectories of {config.n_prompts} prompts in {shards_dir}")
    collect_config = CollectConfig(
        out_dir=shards_dir,
        n_prompts=config.n_prompts,
        block_length=config.block_length,
        gen_length=config.gen_length,
        depth=config.depth,
        prompts_file=config.prompts_file,
    )
    shards = collect(target, codec, collect_config)
    if (out / "drafter.safetensors").is_file():
        progress("make-drafter 2/4: order model already trained (kept)")
        metrics = json.loads((out / "drafter_metrics.json").read_text())
    else:
        progress(f"make-drafter 2/4: order model, {config.minutes:g} min")
        metrics = train_drafter(
            shards_dir,
            out,
            minutes=config.minutes,
            max_depth=config.depth,
            threads=config.threads,
            temperature_feature=True,
        )
        counts = rank_path_counts(load_shards(shards), config.depth)
        write_atomic(out / CALIBRATION_FILE, lambda path: save_rank_counts(counts, path))
    if (out / SURVIVAL_FILE).is_file():
        progress("make-drafter 3/4: token survival already fitted (kept)")
    else:
        progress(f"make-drafter 3/4: token survival on {config.survival_prompts} prompts")
        from spot_dlm.train.collect import prompt_list

        prompts = prompt_list(collect_config)[: config.survival_prompts]
        shape = {"block_length": config.block_length, "gen_length": config.gen_length}
        greedy = observe(target, codec, prompts, 0.0, 0, **shape)
        sampled = observe(target, codec, prompts, 1.0, 0, **shape)
        try:
            save_token_survival(fit_token_survival(greedy, sampled), out)
        except ValueError as err:  # short blocks never reach the deepest staleness: SPOT ranks by position alone
            progress(f"make-drafter 3/4: token survival not fitted ({err}); branches are ranked by position")
    progress(f"make-drafter 4/4: standard decoding and SPOT on {config.check_prompts} held-out questions")
    summary = {
        "made_for": record,
        "held_out_next_commit_accuracy_by_depth": metrics.get("heldout_next_commit_accuracy_by_depth"),
        "held_out_stale_confidence_accuracy_by_depth": metrics.get("heldout_naive_stale_confidence_accuracy_by_depth"),
        "check": check_drafter(target, codec, out, config),
    }
    write_text_atomic(out / RECORD_FILE, json.dumps({**summary, "config": _jsonable(config)}, indent=2))
    return summary


def check_drafter(target, codec, folder: Path, config: MakeDrafterConfig) -> dict:
    """Standard decoding and SPOT (budget 8, this drafter) on held-out GSM8K test questions: passes and exactness."""
    import warnings

    from spot_dlm.api import GenerateConfig, generate
    from spot_dlm.train.data import load_gsm8k

    shape = {"gen_length": config.gen_length, "block_length": config.block_length}
    questions = _fitting(target, codec, [item["question"] for item in load_gsm8k("test")], shape, config.check_prompts)
    if not questions:
        return {"questions": 0, "skipped": "no held-out question fits the model's context"}
    standard = generate(questions, GenerateConfig(method="standard", **shape), target, codec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no bigram in a made folder: plain stale tokens, said in the docs
        spot = generate(
            questions, GenerateConfig(method="spot", budget=8, drafter=str(folder), **shape), target, codec
        )
    passes = [sum(g.target_passes for g in gens) for gens in (standard, spot)]
    return {
        "questions": len(questions),
        "standard_passes": passes[0],
        "spot_passes": passes[1],
        "passes_ratio": passes[0] / passes[1] if passes[1] else 0.0,
        "exact": all(a.raw_token_ids == b.raw_token_ids for a, b in zip(spot, standard)),
    }


def _fitting(target, codec, questions: list[str], shape: dict, n: int) -> list[str]:
    """The first ``n`` questions whose prompt and generation fit the model's context."""
    from spot_dlm.api import GenerateConfig, encode_prompt

    config = GenerateConfig(**shape)
    fitting = []
    for question in questions:
        try:
            encode_prompt(question, codec, config, target)
        except ValueError:
            continue
        fitting.append(question)
        if len(fitting) == n:
            break
    return fitting


def _jsonable(config: MakeDrafterConfig) -> dict:
    return json.loads(json.dumps(asdict(config), default=str))
