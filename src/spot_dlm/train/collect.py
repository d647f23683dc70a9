"""Trajectory logging for drafter training: run standard decoding and record what a drafter could have seen.

For every rule step ``i`` of every block we store the stale features of the state ``s_i`` (top-32 probabilities
of the target's logits at ``s_i``, which positions were masked), the positions step ``i`` committed, and the
stale confidence of the noise-coupled token for the next ``depth`` steps (the feature a drafter reads when it
predicts commit ``i + d``). Shards are ``.npz`` files of plain arrays (loaded with ``allow_pickle=False``);
collection resumes by skipping shards that exist, and Ctrl-C keeps the shards finished. Prompts come from the
training split only. Under torchrun each process decodes every N-th prompt of a shard and rank 0 writes it
(``spot_dlm.distributed``): the shards are those of one process.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from spot_dlm.api import GenerateConfig, encode_prompt, settings_for
from spot_dlm.decode import DraftContext, NoDrafter, StepRecord, decode_ids
from spot_dlm.distributed import Group, current_group, from_main, gather_outcomes
from spot_dlm.drafters.guesses import StaleGuesses
from spot_dlm.drafters.neighbours import NeighbourTokens
from spot_dlm.drafters.order_features import stale_top_probs
from spot_dlm.noise import BlockNoise, NoiseKey
from spot_dlm.safety import check_writable_parent, write_text_atomic

SHARD_ARRAYS = ("top", "masked", "committed", "coupled", "block_id", "step", "prompt_id", "tau", "temperature")
OPTIONAL_SHARD_ARRAYS = ("corrected",)  # collected with neighbour tokens (read when every shard has them)


@dataclass
class TrajectoryLog:
    """Step rows of the blocks decoded so far (one row per rule step)."""

    depth: int
    tau: float = 0.9  # the threshold of the logged rule (unused by one-commit rules)
    temperature: float = 0.0  # the sampling temperature of the logged run
    top: list[np.ndarray] = field(default_factory=list)  # float16 [L, 32]
    masked: list[np.ndarray] = field(default_factory=list)  # bool [L]: masked in s_i
    committed: list[np.ndarray] = field(default_factory=list)  # bool [L]: committed by step i
    coupled: list[np.ndarray] = field(default_factory=list)  # float16 [depth, L]: coupled conf for steps i+1..i+D
    block_id: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    prompt_id: list[int] = field(default_factory=list)
    neighbours: NeighbourTokens | None = None  # with it, the corrected confidence is logged too
    corrected: list[np.ndarray] = field(default_factory=list)  # float16 [depth, L]: as coupled, neighbour-corrected

    def observer(self, key: NoiseKey, settings, mask_id: int, prompt_id: int, block_offset: int):
        memo: dict[int, BlockNoise] = {}  # block index -> its noise tables (one block at a time)
        pending: list[tuple] = []  # (block, step, guesses, coupled, corrected) of rows awaiting later states

        def record(rec: StepRecord) -> None:
            if rec.block_index not in memo:
                memo.clear()
                length, vocab = rec.logits.shape
                memo[rec.block_index] = BlockNoise(key, rec.block_index, length, vocab, rec.logits.device)
            block_noise = memo[rec.block_index]
            block_noise.forget_before(rec.step_index)
            context = DraftContext(
                rec.next_state,
                rec.state,
                rec.logits,
                rec.step_index + 1,
                rec.block_index,
                key,
                settings.rule,
                mask_id,
                block_noise,
            )
            guesses = StaleGuesses(context, self.neighbours)
            coupled = torch.stack([guesses.at(rec.step_index + d).confidence for d in range(1, self.depth + 1)])
            self.top.append(stale_top_probs(rec.logits, mask_id).cpu().numpy().astype(np.float16))
            self.masked.append((rec.state == mask_id).cpu().numpy())
            self.committed.append(((rec.state == mask_id) & (rec.next_state != mask_id)).cpu().numpy())
            self.coupled.append(coupled.clamp_min(0).float().cpu().numpy().astype(np.float16))
            if self.neighbours is not None:
                here = (rec.block_index, rec.step_index)
                pending[:] = [row for row in pending if row[0] == here[0] and 0 < here[1] - row[1] <= self.depth]
                state = rec.state.cpu().numpy()[None]  # [1, L]: s_j, the state step j commits from
                for _, stale_step, stale_guesses, stale_coupled, corrected in pending:
                    d = rec.step_index - stale_step  # row i = j - d predicts this commit at depth d
                    node = stale_guesses.node_confidence(stale_coupled[d - 1][None], [rec.step_index], state)
                    corrected[d - 1] = node[0].clamp_min(0).float().numpy()
                self.corrected.append(self.coupled[-1].copy())  # filled in as the later states arrive
                pending.append((*here, guesses, coupled, self.corrected[-1]))
            self.block_id.append(block_offset + rec.block_index)
            self.step.append(rec.step_index)
            self.prompt_id.append(prompt_id)

        return record

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "top": np.stack(self.top),
            "masked": np.stack(self.masked),
            "committed": np.stack(self.committed),
            "coupled": np.stack(self.coupled),
            "block_id": np.asarray(self.block_id, dtype=np.int64),
            "step": np.asarray(self.step, dtype=np.int16),
            "prompt_id": np.asarray(self.prompt_id, dtype=np.int64),
            "tau": np.full(len(self.step), self.tau, dtype=np.float32),
            "temperature": np.full(len(self.step), self.temperature, dtype=np.float32),
        } | ({"corrected": np.stack(self.corrected)} if self.neighbours is not None else {})


@dataclass(frozen=True)
class CollectConfig:
    out_dir: Path
    n_prompts: int = 200
    prompts_per_shard: int = 25
    temperatures: tuple[float, ...] = (0.0, 1.0)
    block_length: int | None = 32  # None: the model's own (a family checkpoint's trained block)
    gen_length: int = 256
    depth: int = 8
    method: str = "standard"  # the rule whose trajectories are logged (standard, threshold, dynamic)
    taus: tuple[float, ...] = (0.9,)  # threshold rules: one pass over the prompts per tau
    seed: int = 1
    worker: int = 0  # this process writes the shards whose job index % workers == worker
    workers: int = 1
    neighbours: str | None = None  # drafter folder whose bigram fit corrects the logged confidence (None: not logged)
    prompts_file: str | None = None  # one prompt per line, in place of the training questions

    def __post_init__(self):
        if self.workers < 1 or not 0 <= self.worker < self.workers:
            raise ValueError(f"worker must be in [0, workers), got {self.worker}/{self.workers}")
        if min(self.n_prompts, self.prompts_per_shard, self.depth) < 1:
            raise ValueError("--n-prompts, prompts per shard and --depth must be >= 1")
        if not self.temperatures or not self.taus:
            raise ValueError("give at least one temperature and tau")
        for temperature in self.temperatures:  # every logged rule's config, checked before any work
            for tau in self.taus:
                logged_config(self, temperature, tau)


def logged_config(config: CollectConfig, temperature: float, tau: float) -> GenerateConfig:
    """The decoding config whose trajectories are logged at one temperature and tau."""
    return GenerateConfig(
        method=config.method,
        block_length=config.block_length,
        gen_length=config.gen_length,
        temperature=temperature,
        seed=config.seed,
        tau=tau,
    )


PROMPT_ORDER = 2  # recorded with a collection; folders without it hold the order before it was prefix-stable


def collection_prompts(n: int, seed: int = 0) -> list[str]:
    """Training-split questions only, alternating GSM8K train (in a seeded order) and gsm_symbolic (training seed).

    Prefix-stable: the first n prompts of a longer collection are the n-prompt collection, so a folder of shards
    can be extended by collecting again with a larger ``n`` (prompt ids stay those of the shards already there).
    """
    from spot_dlm.train.data import TRAIN_SYMBOLIC_SEED, gsm_symbolic_items, load_gsm8k

    gsm8k = load_gsm8k("train")
    if n - n // 2 > len(gsm8k):
        raise ValueError(f"{n} prompts need {n - n // 2} GSM8K train questions; it has {len(gsm8k)}")
    order = np.random.default_rng(seed).permutation(len(gsm8k))
    symbolic = gsm_symbolic_items(TRAIN_SYMBOLIC_SEED, n // 2) if n >= 2 else []  # reasoning-gym needs size >= 1
    return [gsm8k[order[i // 2]]["question"] if i % 2 == 0 else symbolic[i // 2]["question"] for i in range(n)]


def prompt_list(config: CollectConfig) -> list[str]:
    """The collection's prompts: the first ``n_prompts`` lines of ``prompts_file``, else the training questions."""
    if config.prompts_file is None:
        return collection_prompts(config.n_prompts, config.seed)
    path = Path(config.prompts_file)
    if not path.is_file():
        raise ValueError(f"prompts file not found: {path}")
    prompts = [line for line in path.read_text().splitlines() if line.strip()]
    if len(prompts) < config.n_prompts:
        raise ValueError(f"{path} holds {len(prompts)} prompts; {config.n_prompts} asked for")
    return prompts[: config.n_prompts]


def recorded_settings(config: CollectConfig) -> dict:
    """What a folder of shards records about how it was collected (JSON types; worker split left out)."""
    fields = {k: v for k, v in asdict(config).items() if k not in ("worker", "workers")}
    return json.loads(json.dumps({**fields, "out_dir": str(config.out_dir), "prompt_order": PROMPT_ORDER}))


def check_same_collection(before: dict, now: dict) -> None:
    """Shards may only be added to a folder collected with the same settings; only ``n_prompts`` may differ (the
    prompt order is prefix-stable). Raises ValueError naming what differs."""
    differs = sorted(k for k in before.keys() | now.keys() if k != "out_dir" and before.get(k) != now.get(k))
    if [k for k in differs if k != "n_prompts"]:
        changes = ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in differs)
        raise ValueError(
            f"{now['out_dir']} holds a collection made with other settings ({changes}); collect into a new folder"
        )


def collect(target, codec, config: CollectConfig) -> list[Path]:
    """Run standard decoding over training prompts at each temperature; write resumable shards.

    With `workers` > 1, several processes share one folder: each writes every `workers`-th shard and returns its own.
    Under torchrun the processes of one worker share each shard's prompts; rank 0 alone writes.
    """
    group = current_group()
    neighbours = neighbour_fit(config.neighbours, target.vocab_size)  # refused before the folder is touched
    prompts = prompt_list(config)
    taus = config.taus if config.method in ("threshold", "dynamic") else config.taus[:1]
    jobs = shard_jobs(config, taus, len(prompts))
    pending, recorded = from_main(lambda: prepare_folder(config, jobs, len(prompts)), group)
    record_path = config.out_dir / "collect_config.json"
    shards = []
    try:
        for (temperature, tau, start), todo in zip(
            tqdm(jobs, desc="collect shards", disable=not group.is_main), pending
        ):
            path = shard_path(config.out_dir, temperature, tau, start)
            if todo:  # a shorter last shard of a smaller collection is collected again, whole
                ids = range(start, min(start + config.prompts_per_shard, len(prompts)))
                log = TrajectoryLog(depth=config.depth, tau=tau, temperature=temperature, neighbours=neighbours)
                arrays = collect_shared(
                    target, codec, logged_config(config, temperature, tau), prompts, ids, log, group
                )
                if group.is_main:
                    write_shard(path, arrays)
            shards.append(path)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"kept {len(shards)} finished shard(s) in {config.out_dir}") from None
    finally:  # what the shards hold, not what was asked for
        if group.is_main:
            recorded["n_prompts"] = covered_prompts(
                config.out_dir, config.temperatures, taus, config.prompts_per_shard
            )
            write_text_atomic(record_path, json.dumps(recorded))
    return shards


def shard_jobs(config: CollectConfig, taus, n_prompts: int) -> list[tuple[float, float, int]]:
    """(temperature, tau, first prompt) of every shard this worker writes (``worker`` of ``workers``)."""
    starts = range(0, n_prompts, config.prompts_per_shard)
    jobs = [(t, tau, start) for t in config.temperatures for tau in taus for start in starts]
    return jobs[config.worker :: config.workers]


def prepare_folder(config: CollectConfig, jobs, n_prompts: int) -> tuple[list[bool], dict]:
    """Check and record the collection in ``out_dir`` (refusing one made with other settings); -> which jobs still
    need collecting, and the record."""
    if config.out_dir.exists() and not config.out_dir.is_dir():
        raise ValueError(f"--out {config.out_dir} is a file, not a folder")
    check_writable_parent(config.out_dir / "x", "--out")
    recorded, record_path = recorded_settings(config), config.out_dir / "collect_config.json"
    if record_path.is_file():
        before = json.loads(record_path.read_text())
        check_same_collection(before, recorded)
        recorded["n_prompts"] = max(before["n_prompts"], recorded["n_prompts"])  # until the shards are counted
    config.out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(record_path, json.dumps(recorded))
    ends = [min(start + config.prompts_per_shard, n_prompts) for _, _, start in jobs]
    pending = [not holds_prompts(shard_path(config.out_dir, *job), job[2], end) for job, end in zip(jobs, ends)]
    return pending, recorded


@dataclass(frozen=True)
class PromptLog:
    """The step rows of one prompt (block ids counted from 0) and how many blocks it spans."""

    prompt_id: int
    arrays: dict[str, np.ndarray]
    blocks: int


def collect_shared(target, codec, gen_config: GenerateConfig, prompts, ids: range, log: TrajectoryLog, group: Group):
    """The shard of prompts ``ids``: this rank logs every ``world``-th prompt of it (each in a fresh copy of the
    empty ``log``); -> the arrays of all ranks' prompts in prompt order, as one process logs them."""

    def share() -> list[PromptLog]:
        logs = []
        for prompt_id in ids[group.rank :: group.world]:
            one = TrajectoryLog(log.depth, log.tau, log.temperature, neighbours=log.neighbours)
            blocks = collect_shard(target, codec, gen_config, prompts, range(prompt_id, prompt_id + 1), one)
            logs.append(PromptLog(prompt_id, one.arrays(), blocks))
        return logs

    return merge_prompt_logs([one for logs in gather_outcomes(share, group) for one in logs])


def merge_prompt_logs(logs: list[PromptLog]) -> dict[str, np.ndarray]:
    """One shard's arrays from its prompts' logs: in prompt order, each prompt's block ids after the blocks of the
    prompts before it."""
    ordered = sorted(logs, key=lambda one: one.prompt_id)
    offsets = np.cumsum([0] + [one.blocks for one in ordered])
    return {
        name: np.concatenate(
            [
                one.arrays[name] + offset if name == "block_id" else one.arrays[name]
                for one, offset in zip(ordered, offsets)
            ]
        )
        for name in ordered[0].arrays
    }


def collect_shard(
    target, codec, gen_config: GenerateConfig, prompts: list[str], ids: range, log: TrajectoryLog
) -> int:
    """Decode the prompts ``ids`` (request index = prompt id) by ``gen_config``'s rule, logging every step; -> the
    blocks they span."""
    settings = settings_for(gen_config, target)
    block_offset = 0
    for prompt_id in ids:
        key = NoiseKey(gen_config.seed, prompt_id)
        prompt = encode_prompt(prompts[prompt_id], codec, gen_config, target)
        observer = log.observer(key, settings, target.mask_id, prompt_id, block_offset)
        raw = decode_ids(target, prompt, settings, NoDrafter(), key, observer)
        block_offset += -(-raw.token_ids.shape[0] // settings.block_length)  # blocks it spans (a prompt tail too)
    return block_offset


def write_shard(path: Path, arrays: dict[str, np.ndarray]) -> None:
    partial = path.with_name(path.name + ".partial")  # not matched by shard_*.npz while being written
    with partial.open("wb") as handle:
        np.savez_compressed(handle, **arrays)
    partial.replace(path)


def neighbour_fit(folder: str | None, vocab_size: int) -> NeighbourTokens | None:
    """The bigram fit of a drafter folder (None for None); a folder without one, or of another vocabulary, is an
    error: a collection asked to log corrected confidence must not silently log none."""
    if folder is None:
        return None
    from spot_dlm.drafters.neighbours import load_neighbour_fit

    if not Path(folder).is_dir():
        raise FileNotFoundError(f"drafter folder not found: {folder}")
    fit = load_neighbour_fit(Path(folder), vocab_size)
    if fit is None:
        raise ValueError(f"{folder} has no bigram fit (spot-dlm fit-bigram and fit-token-survival make one)")
    return fit[0]


def shard_path(out_dir: Path, temperature: float, tau: float, start: int) -> Path:
    return out_dir / f"shard_T{temperature:g}_tau{tau:g}_{start:05d}.npz"


def shard_prompt_ids(path: Path) -> np.ndarray:
    """The distinct prompt ids of one shard, sorted."""
    with np.load(path, allow_pickle=False) as data:
        return np.unique(data["prompt_id"])


def holds_prompts(path: Path, first: int, end: int) -> bool:
    """Whether the shard exists and holds every prompt in [first, end)."""
    return path.exists() and bool(np.isin(np.arange(first, end), shard_prompt_ids(path)).all())


def covered_prompts(out_dir: Path, temperatures, taus, per_shard: int) -> int:
    """How many prompts, counted from the first, the folder's shards hold at every temperature and tau."""
    covered = []
    for temperature in temperatures:
        for tau in taus:
            end = 0
            while (path := shard_path(out_dir, temperature, tau, end)).exists():
                ids = shard_prompt_ids(path)
                if not len(ids) or ids[0] != end:
                    break
                full, end = ids[-1] + 1 - end == per_shard, int(ids[-1]) + 1
                if not full:  # a short last shard: no shard starts after it
                    break
            covered.append(end)
    return min(covered)


def load_shards(paths: list[Path]) -> dict[str, np.ndarray]:
    """Concatenate shards; rows of one block stay consecutive and in step order."""
    if not paths:
        raise FileNotFoundError("no trajectory shards given")
    loaded = []
    for path in paths:
        with np.load(path, allow_pickle=False) as data:
            missing = [name for name in SHARD_ARRAYS if name not in data]
            if missing:
                raise ValueError(f"trajectory shard {path} lacks arrays {missing}")
            loaded.append({name: data[name] for name in SHARD_ARRAYS + OPTIONAL_SHARD_ARRAYS if name in data})
    names = [name for name in SHARD_ARRAYS + OPTIONAL_SHARD_ARRAYS if all(name in shard for shard in loaded)]
    merged = {name: [] for name in names}
    for index, shard in enumerate(loaded):
        for name in names:
            value = shard[name]
            merged[name].append(value + index * 10_000_000 if name == "block_id" else value)  # unique per shard
    return {name: np.concatenate(values) for name, values in merged.items()}
