"""``spot-dlm bench``: every method side by side in one process, on the same prompts and noise seeds.

Per (task, temperature): standard decoding is the reference for exact match, the oracle and the ratios; every
other method x budget decodes the same prompts with the same keyed noise. Decoding is interleaved: prompt by
prompt, every setting in turn (baselines first), so a drift in machine speed hits all methods alike. Each setting
gets an untimed warm-up. Threshold-family methods (threshold, dynamic, spot-sets) are compared with their own
drafter-free threshold baseline at the same tau. Under torchrun each process decodes every N-th prompt and rank 0
puts the generations back in prompt order (``spot_dlm.distributed``): the rows are those of one process.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from spot_dlm.api import (
    GenerateConfig,
    Generation,
    encode_prompt,
    generate,
    make_drafter,
    neighbour_fit,
    settings_for,
)
from spot_dlm.bench.output import machine_description
from spot_dlm.bench.rows import parse_row, threshold_family
from spot_dlm.decode import Drafter, RawGeneration
from spot_dlm.distributed import Group, current_group, gather_outcomes, interleave, local_device
from spot_dlm.drafters.folder import DrafterFolder
from spot_dlm.drafters.simple import OracleDrafter
from spot_dlm.tasks import TASKS, is_correct, task_items
from spot_dlm.tree import DEFAULT_DEPTH

SPECULATIVE = ("spot", "stale", "chain", "calibrated", "oracle", "order-oracle")


@dataclass(frozen=True)
class BenchConfig:
    methods: tuple[str, ...] = ("standard", "spot", "stale", "chain", "calibrated", "oracle")
    budgets: tuple[int, ...] = (4, 8, 16, 32)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    tasks: tuple[str, ...] = ("gsm8k",)
    n_prompts: int = 50
    block_length: int | None = None  # None: the model's own (a family checkpoint's trained block; else 32)
    gen_length: int = 256
    depth: int = DEFAULT_DEPTH
    seed: int = 0
    taus: tuple[float, ...] = (0.9,)
    model: str | None = None
    drafter: str | None = None
    device: str = "cpu"
    trust_remote_code: bool = False  # transformers models: run the folder's own modeling code
    device_map: str | None = None  # transformers models: accelerate's placement over GPUs (e.g. "auto")

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown}; choose from {', '.join(TASKS)}")
        if self.n_prompts < 1:
            raise ValueError("n_prompts must be >= 1")
        if not self.budgets or min(self.budgets) < 1:
            raise ValueError("budgets must be >= 1")
        if not self.methods or not self.temperatures or not self.taus:
            raise ValueError("give at least one method, temperature and tau")
        for method, budget, tau in [("standard", None, None), *_jobs(self)]:  # every row's config, checked now
            for temperature in self.temperatures:
                setting_config(method, budget, temperature, tau, self)


def as_raw(gen: Generation) -> RawGeneration:
    return RawGeneration(
        token_ids=torch.tensor(gen.raw_token_ids),
        commit_step=torch.tensor(gen.commit_step),
        commit_pass=torch.tensor(gen.commit_pass),
        stats=None,
    )


def longest_repeat(token_ids: list[int]) -> int:
    """The longest run of one token repeated back to back (0 for no tokens): long runs (a small target's digit
    collapses) are where drafts are accepted whole, so reports split passes by it."""
    longest, run = min(len(token_ids), 1), 1
    for before, after in zip(token_ids, token_ids[1:]):
        run = run + 1 if after == before else 1
        longest = max(longest, run)
    return longest


def tokens_digest(token_ids: list[int]) -> str:
    """A short fingerprint of a decoding's tokens: two runs (machines, process counts) decoded a prompt alike when
    their digests agree."""
    return hashlib.blake2b(json.dumps(token_ids).encode(), digest_size=8).hexdigest()


def summarise(gens: list[Generation], items: list[dict], reference: list[Generation] | None) -> dict:
    passes = sum(g.stats["target_passes"] for g in gens)
    tokens = sum(len(g.token_ids) for g in gens)
    wall = sum(g.stats["wall_seconds"] for g in gens)
    hist: dict[str, int] = {}
    for g in gens:
        for k, v in g.stats["accepted_lengths"].items():
            hist[k] = hist.get(k, 0) + v
    verify = sum(hist.values())
    endings: Counter = Counter()
    for g in gens:
        endings.update(g.stats["round_endings"])
    correct = [is_correct(g.text, item.get("answer")) for g, item in zip(gens, items)]
    scored = [c for c in correct if c is not None]
    return {
        "target_passes": passes,
        "generated_tokens": tokens,
        "committed_tokens": sum(g.stats["committed_tokens"] for g in gens),
        "query_tokens": sum(g.stats["query_tokens"] for g in gens),
        "wall_seconds": wall,
        "draft_seconds": sum(g.stats["draft_seconds"] for g in gens),
        "tokens_per_second": tokens / wall if wall else 0.0,
        "tokens_per_pass": sum(g.stats["committed_tokens"] for g in gens) / passes,
        "mean_accepted": sum(int(k) * v for k, v in hist.items()) / verify if verify else 0.0,
        "accepted_lengths": hist,
        "handoff_blocks": sum(g.stats["handoff_blocks"] for g in gens),
        "round_endings": dict(sorted(endings.items())),
        "passes_per_prompt": [g.stats["target_passes"] for g in gens],
        "longest_repeat_per_prompt": [longest_repeat(g.token_ids) for g in gens],
        "tokens_digest_per_prompt": [tokens_digest(g.raw_token_ids) for g in gens],
        "accuracy": sum(scored) / len(scored) if scored else None,
        "exact_match_vs_standard": (
            None
            if reference is None
            else sum(g.raw_token_ids == r.raw_token_ids for g, r in zip(gens, reference)) / len(gens)
        ),
    }


@dataclass
class Setting:
    """One row of the report: a method at a budget (and tau), its decoding config, drafter and generations."""

    method: str  # the row as requested, its options included (e.g. spot:handoffs=off)
    budget: int | None  # None for drafter-free rows
    tau: float | None  # set for threshold-family rows
    baseline: str | None  # key of the setting it is compared with; None for standard itself
    config: GenerateConfig
    drafter: Drafter
    generations: list[Generation] = field(default_factory=list)


def make_setting(
    target, method: str, budget: int | None, temperature: float, tau: float | None, bench: BenchConfig, references
) -> Setting:
    """Config and drafter of one row. ``references`` (request index -> reference decoding) is filled by the caller
    prompt by prompt; only the oracles read it."""
    base = parse_row(method)[0]
    config = setting_config(method, budget, temperature, tau, bench)
    if base in ("oracle", "sets-oracle", "order-oracle"):
        stale_tokens = base == "order-oracle"
        neighbours = order_oracle_neighbours(config, target) if stale_tokens else None
        drafter = OracleDrafter(
            references, config.block_length, config.budget, config.depth, stale_tokens, base, neighbours
        )
    else:
        drafter = make_drafter(config, target)
    family = threshold_family(method)
    baseline = None if method == "standard" else (f"{family}@{tau}" if family and budget else "standard")
    return Setting(method, budget, tau if family else None, baseline, config, drafter)


def setting_config(method: str, budget: int | None, temperature: float, tau: float | None, bench: BenchConfig):
    """The GenerateConfig of one row (a ValueError for a method, budget or setting that cannot run)."""
    base, options = parse_row(method)
    gen_method = {"sets-oracle": "threshold", "oracle": "standard", "order-oracle": "standard"}.get(base, base)
    return GenerateConfig(
        **options,
        method=gen_method,
        block_length=bench.block_length,
        gen_length=bench.gen_length,
        temperature=temperature,
        seed=bench.seed,
        budget=budget or 1,
        depth=bench.depth,
        tau=0.9 if tau is None else tau,
        drafter=bench.drafter,
    )


def order_oracle_neighbours(config: GenerateConfig, target):
    """The neighbour correction SPOT would use with this config (None: off, or no fit in the drafter folder)."""
    fit = neighbour_fit(config, target, DrafterFolder.for_method(config.drafter, "spot", target.device))
    return None if fit is None else fit[0]


def plan_settings(target, temperature: float, bench: BenchConfig) -> tuple[list[Setting], dict[str, dict]]:
    """Every row of one (task, temperature), baselines before the rows compared with them.

    Returns the settings and, per baseline key, the reference dict its oracle rows read (filled while decoding)."""
    references: dict[str, dict] = {"standard": {}}
    settings = {"standard": make_setting(target, "standard", None, temperature, None, bench, None)}
    for method, budget, tau in _jobs(bench):
        family = threshold_family(method)
        base_key = f"{family}@{tau}" if family else "standard"
        if family and base_key not in settings:
            references[base_key] = {}
            settings[base_key] = make_setting(target, family, None, temperature, tau, bench, None)
        if method not in ("threshold", "dynamic"):
            setting = make_setting(target, method, budget, temperature, tau, bench, references[base_key])
            settings[setting_key(setting)] = setting
    return list(settings.values()), references


def setting_key(setting: Setting) -> str:
    if setting.budget is None:
        return "standard" if setting.tau is None else f"{setting.config.method}@{setting.tau}"
    return f"{setting.method}#{setting.budget}@{setting.tau}"


def warm_up(setting: Setting, prompt: str, target, codec) -> None:
    """One untimed block, so first-call costs (allocations, lazy loads) stay out of the timings."""
    block = settings_for(setting.config, target).block_length  # the model's own when the config leaves it unset
    warm = GenerateConfig(**{**asdict(setting.config), "gen_length": block})
    drafter = None if isinstance(setting.drafter, OracleDrafter) else setting.drafter
    generate([prompt], warm, target, codec, drafter=drafter)


def decode_interleaved(
    settings: list[Setting],
    references: dict[str, dict],
    prompts,
    target,
    codec,
    desc,
    progress,
    indices: Sequence[int] | None = None,
) -> bool:
    """Prompt by prompt, every setting in turn: a drift in machine speed (other load, clocks) then hits every
    method alike instead of whichever ran during it. Baselines come first, so each prompt's reference exists
    before an oracle reads it. ``indices``: the prompts to decode (default all; a rank's share under torchrun),
    each with its index as request index. Returns True when interrupted (Ctrl-C): the settings then keep the
    prompts that every one of them finished."""
    indices = range(len(prompts)) if indices is None else indices
    try:
        for setting in settings if len(indices) else ():
            warm_up(setting, prompts[indices[0]], target, codec)
        for index in tqdm(indices, desc=desc, disable=not progress):
            prompt = prompts[index]
            for setting in settings:
                config, drafter = setting.config, setting.drafter
                gen = generate([prompt], config, target, codec, drafter=drafter, first_request=index)[0]
                setting.generations.append(gen)
                if setting.budget is None:  # a drafter-free baseline: record its reference
                    references.get(setting_key(setting), {})[index] = as_raw(gen)
    except KeyboardInterrupt:
        finished = min(len(setting.generations) for setting in settings)
        for setting in settings:
            del setting.generations[finished:]
        return True
    return False


def run_bench(bench: BenchConfig, target=None, codec=None, progress: bool = True) -> dict:
    """Every row of the benchmark. Interrupted (Ctrl-C), it returns the rows of the prompts finished so far, with
    ``interrupted`` set in the report."""
    from spot_dlm.api import load_target

    group = current_group()
    if target is None:
        hf_options = {"trust_remote_code": bench.trust_remote_code, "device_map": bench.device_map}
        target, codec = load_target(bench.model, hf_options=hf_options, device=local_device(bench.device))
    rows, interrupted = [], False
    for task in bench.tasks:
        if interrupted:
            break
        items = task_items(task, bench.n_prompts)
        cfg = GenerateConfig(block_length=bench.block_length, gen_length=bench.gen_length)
        items = [it for it in items if _fits(it["question"], codec, cfg, target)]
        if not items:
            raise ValueError(
                f"no {task} prompt fits the model's {target.max_length}-token context with gen length "
                f"{bench.gen_length}"
            )
        prompts = [item["question"] for item in items]
        for temperature in bench.temperatures:
            settings, references = plan_settings(target, temperature, bench)
            desc = f"{task} T={temperature:g}"
            decode = (settings, references, prompts, target, codec, desc, progress and group.is_main)
            interrupted = decode_shared(decode, group)
            by_key = {setting_key(s): s for s in settings}
            done = items[: len(settings[0].generations)]  # fewer when interrupted
            for s in settings if done else ():
                reference = by_key[s.baseline].generations if s.baseline else None
                rows.append(
                    _row(task, s.method, s.budget, temperature, s.tau, s.generations, done, reference, s.baseline)
                )
            if interrupted:
                break
    report = {
        "config": asdict(bench),
        "machine": machine_description(target.device),
        "torch_threads": torch.get_num_threads(),
        "results": rows,
    }
    if group.world > 1:
        report["processes"] = group.world
    return report | ({"interrupted": True} if interrupted else {})


def decode_shared(decode: tuple, group: Group) -> bool:
    """``decode_interleaved(*decode)`` over this rank's share of the prompts; then every setting holds the
    generations of all ranks in prompt order (up to the first prompt a rank left unfinished). True when any rank
    was interrupted."""
    settings, prompts = decode[0], decode[2]

    def share() -> tuple[bool, list[list[Generation]]]:
        stopped = decode_interleaved(*decode, indices=group.share(len(prompts)))
        return stopped, [setting.generations for setting in settings]

    outcomes = gather_outcomes(share, group)
    for index, setting in enumerate(settings):
        setting.generations = interleave([generations[index] for _, generations in outcomes])
    return any(stopped for stopped, _ in outcomes)


def _fits(question: str, codec, cfg: GenerateConfig, target) -> bool:
    try:
        encode_prompt(question, codec, cfg, target)
    except ValueError:
        return False
    return True


def _jobs(bench: BenchConfig) -> list[tuple[str, int, float]]:
    jobs = []
    for method in bench.methods:
        if method == "standard":
            continue
        if method in ("threshold", "dynamic"):
            jobs += [(method, 1, tau) for tau in bench.taus]
        elif threshold_family(method):
            jobs += [(method, b, tau) for tau in bench.taus for b in bench.budgets]
        else:
            jobs += [(method, b, 0.9) for b in bench.budgets]
    return jobs


def _row(task, method, budget, temperature, tau, gens, items, reference, baseline_name) -> dict:
    summary = summarise(gens, items, reference)
    row = {
        "task": task,
        "method": method,
        "budget": budget,
        "temperature": temperature,
        "tau": tau,
        "n_prompts": len(gens),
        **summary,
    }
    if reference is not None:
        base = summarise(reference, items, None)
        row["baseline"] = baseline_name
        row["passes_ratio_vs_standard"] = base["target_passes"] / summary["target_passes"]
        row["throughput_ratio_vs_standard"] = summary["tokens_per_second"] / base["tokens_per_second"]
    else:  # the standard row itself
        row.update(
            baseline="standard",
            passes_ratio_vs_standard=1.0,
            throughput_ratio_vs_standard=1.0,
            exact_match_vs_standard=1.0,
        )
    return row
