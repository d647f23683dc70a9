"""Train SPOT's order model on logged trajectories; report held-out next-commit accuracy by depth.

An example is (stale features of ``s_i``, commits of steps ``i .. i+d-1`` marked as committed on the branch)
-> the position committed by step ``i + d``, for ``d = 1 .. D``. Prompts are split 90/10 into train and held out.

A folder holding a trained drafter is only written with ``init`` = that folder (training continues it) or ``force``
(it is replaced, and the fits made for it are removed). Ctrl-C keeps the model trained so far.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from spot_dlm.drafters.folder import (
    DRAFTER_CONFIG_FILE,
    DRAFTER_WEIGHTS_FILE,
    check_drafter_kind,
    load_order_model,
    read_drafter_config,
    save_order_model,
)
from spot_dlm.drafters.neighbours import BIGRAM_FILE, NEIGHBOUR_FIT_FILE
from spot_dlm.drafters.order_features import N_FLAG_FEATURES, order_features
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.drafters.token_lm import TOKEN_LM_DIR, TOKEN_LM_FIT_FILE
from spot_dlm.drafters.token_survival import SURVIVAL_FILE
from spot_dlm.safety import check_minutes
from spot_dlm.train.collect import load_shards

CALIBRATION_FILE = "calibration.json"
# what a drafter folder holds besides the order model, fitted for it: replaced with it, these are removed
DRAFTER_FITS = (
    BIGRAM_FILE,
    NEIGHBOUR_FIT_FILE,
    SURVIVAL_FILE,
    TOKEN_LM_FIT_FILE,
    TOKEN_LM_DIR,
    CALIBRATION_FILE,
    "small",
)


@dataclass(frozen=True)
class Examples:
    row: np.ndarray  # int64 [M]: step row i
    depth: np.ndarray  # int64 [M]: d >= 1 (predict the commit of step i + d)


def examples_where(ex: Examples, keep: np.ndarray) -> Examples:
    """The examples whose ``keep`` flag (bool [M]) is set."""
    return Examples(row=ex.row[keep], depth=ex.depth[keep])


def by_temperature(data: dict[str, np.ndarray], ex: Examples, measure) -> dict[str, dict[int, float]]:
    """``measure(examples)`` on the examples of each logged temperature, keyed by the temperature as text."""
    temperature = data["temperature"][ex.row]
    return {f"{t:g}": measure(examples_where(ex, temperature == t)) for t in np.unique(temperature)}


def build_examples(data: dict[str, np.ndarray], max_depth: int, rows: np.ndarray, sets: bool = False) -> Examples:
    """All (i, d) with rows i and i + d in the same block, i in ``rows`` (order model: one commit at step i + d)."""
    block, n_rows = data["block_id"], len(data["block_id"])
    one_commit = np.ones(n_rows, dtype=bool) if sets else data["committed"].sum(-1) == 1
    picks_row, picks_depth = [], []
    for d in range(1, max_depth + 1):
        i = rows[rows + d < n_rows]
        ok = (block[i + d] == block[i]) & one_commit[i + d]
        picks_row.append(i[ok])
        picks_depth.append(np.full(int(ok.sum()), d))
    return Examples(row=np.concatenate(picks_row), depth=np.concatenate(picks_depth))


def batch_tensors(
    data: dict[str, np.ndarray],
    cum_committed: np.ndarray,
    ex: Examples,
    index: np.ndarray,
    config: OrderModelConfig | None = None,
):
    """Features float32 [B, L, F], allowed bool [B, L], target int64 [B] for the chosen examples."""
    i, d = ex.row[index], ex.depth[index]
    branch = (cum_committed[i + d] - cum_committed[i]) > 0  # committed by steps i .. i+d-1
    masked = data["masked"][i]
    coupled = data["coupled"][i, d - 1]  # [B, L]
    allowed = masked & ~branch
    corrected = None
    if "corrected" in data:  # neighbour-corrected confidence, 0 where nothing is left to commit (as in decoding)
        corrected = torch.from_numpy(np.where(allowed, data["corrected"][i, d - 1], 0).astype(np.float32))
    before = np.maximum(i - 1, 0)  # row of the state one commit earlier, when it is in the same block
    has_previous = (data["step"][i] > 0) & (data["block_id"][before] == data["block_id"][i])
    previous = np.where(has_previous[:, None], data["top"][before, :, 0], 0).astype(np.float32)  # [B, L]
    features = order_features(
        torch.from_numpy(data["top"][i].astype(np.float32)),
        torch.from_numpy(masked),
        torch.from_numpy(branch),
        torch.from_numpy(coupled.astype(np.float32)),
        (config or OrderModelConfig()).extra_inputs(
            torch.from_numpy(data["tau"][i]),
            torch.from_numpy(data["temperature"][i]),
            torch.from_numpy(previous),
            torch.from_numpy(has_previous),
            corrected,
        ),
    )
    allowed = torch.from_numpy(allowed)
    target = torch.from_numpy(data["committed"][i + d])  # bool [B, L]: the set committed by step i + d
    return features, allowed, target


def objective_loss(model: OrderModel, features, allowed, target, sets: bool) -> torch.Tensor:
    """Order model: cross-entropy over allowed positions; sets model: per-position BCE on allowed positions."""
    logits = model(features)
    if not sets:
        return F.cross_entropy(logits.masked_fill(~allowed, float("-inf")), target.float().argmax(-1))
    losses = F.binary_cross_entropy_with_logits(logits, target.float(), reduction="none")
    return (losses * allowed).sum() / allowed.sum().clamp_min(1)


def predicted_set(model: OrderModel, features, allowed) -> torch.Tensor:
    """The set a sets model proposes first: positions with q >= 0.5 plus the most likely one. -> bool [B, L]"""
    logits = model(features).masked_fill(~allowed, float("-inf"))
    top = torch.zeros_like(allowed).scatter_(-1, logits.argmax(-1, keepdim=True), True)
    return ((torch.sigmoid(logits) >= 0.5) | top) & allowed


def masked_logits(model: OrderModel, features: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return model(features).masked_fill(~allowed, float("-inf"))


@torch.no_grad()
def accuracy_by_depth(
    model, data, cum, ex: Examples, max_depth: int, sets: bool = False, batch_size: int = 2048
) -> dict[int, float]:
    """Order model: next-commit position accuracy; sets model: exact-set accuracy of the first proposed set."""
    model.eval()
    correct, total = np.zeros(max_depth + 1), np.zeros(max_depth + 1)
    for start in range(0, len(ex.row), batch_size):
        index = np.arange(start, min(start + batch_size, len(ex.row)))
        features, allowed, target = batch_tensors(data, cum, ex, index, model.config)
        if sets:
            hit = (predicted_set(model, features, allowed) == target).all(-1).numpy()
        else:
            hit = (masked_logits(model, features, allowed).argmax(-1) == target.float().argmax(-1)).numpy()
        np.add.at(correct, ex.depth[index], hit)
        np.add.at(total, ex.depth[index], 1)
    model.train()
    return {d: float(correct[d] / total[d]) for d in range(1, max_depth + 1) if total[d] > 0}


def naive_accuracy(data, cum, ex: Examples, max_depth: int) -> dict[int, float]:
    """The training-free guess: the most confident coupled stale token among allowed positions."""
    out = {}
    for d in range(1, max_depth + 1):
        index = np.flatnonzero(ex.depth == d)
        if len(index) == 0:
            continue
        features, allowed, target = batch_tensors(data, cum, ex, index)
        coupled = features[..., OrderModelConfig().top_k + N_FLAG_FEATURES - 1]  # [B, L]
        guess = coupled.masked_fill(~allowed, -1.0).argmax(-1)
        out[d] = float((guess == target.float().argmax(-1)).float().mean())
    return out


DEFAULT_SHAPE = (OrderModelConfig.d_model, OrderModelConfig.n_layers, OrderModelConfig.n_heads)


def warm_start(folder: Path, config: OrderModelConfig) -> OrderModel:
    """A trained drafter to continue from. Its config must be the one asked for, except that ``config`` may read
    more inputs (e.g. the temperature): their input weights start at zero, so training starts from the same function.
    """
    trained = load_order_model(folder).train()
    if trained.config == config:
        return trained
    old, new = trained.config.feature_names, config.feature_names
    if replace(trained.config, **_feature_flags(config)) != config or not set(old) <= set(new):
        raise ValueError(f"drafter in {folder} has config {trained.config}, training asks for {config}")
    weights = trained.state_dict()
    widened = torch.zeros(config.d_model, len(new))
    widened[:, [new.index(name) for name in old]] = weights["input.weight"]  # [d, F_new]: new columns zero
    model = OrderModel(config)
    model.load_state_dict({**weights, "input.weight": widened})
    return model.train()


def holds_drafter(folder: Path) -> bool:
    return any((Path(folder) / name).exists() for name in (DRAFTER_WEIGHTS_FILE, DRAFTER_CONFIG_FILE))


def check_drafter_output(out_dir: Path, init: Path | None, force: bool) -> None:
    """``out_dir`` may be written: a folder (or nothing yet) without a trained drafter, the drafter ``init`` continues,
    or any with ``force``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} is a file, not a folder")
    continues = init is not None and Path(init).resolve() == out_dir.resolve()
    if holds_drafter(out_dir) and not (continues or force):
        raise ValueError(
            f"--out {out_dir} already holds a trained drafter: give --init {out_dir} to continue it, --force to "
            "replace it (its fits are removed with it), or another --out"
        )


def check_warm_start(init: Path, sets: bool) -> None:
    """The folder to continue holds a drafter of the kind asked for (an order model, or a sets model with ``sets``)."""
    config = read_drafter_config(init)
    if config is None:
        raise FileNotFoundError(f"--init: no drafter in {init} (expected {Path(init) / DRAFTER_CONFIG_FILE})")
    check_drafter_kind(config, sets, init)


def held_fits(folder: Path) -> list[str]:
    """The fits (``DRAFTER_FITS``) a drafter folder holds."""
    return [name for name in DRAFTER_FITS if (Path(folder) / name).exists()]


def remove_fits(folder: Path, names: list[str]) -> None:
    """Remove the fits made for a replaced drafter."""
    for name in names:
        path = Path(folder) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def check_examples(shard_dir: Path, n_prompts: int, train: Examples, held: Examples) -> None:
    """Training needs prompts on both sides of the split and examples in each."""
    if n_prompts < 2:
        raise ValueError(
            f"the shards in {shard_dir} hold {n_prompts} prompt(s); training needs at least 2 (a tenth are held out)"
        )
    if not len(train.row) or not len(held.row):
        side = "training" if not len(train.row) else "held-out"
        raise ValueError(f"the shards in {shard_dir} give no {side} examples: collect more prompts")


def _feature_flags(config: OrderModelConfig) -> dict[str, bool]:
    names = ("threshold_feature", "temperature_feature", "previous_feature", "corrected_feature")
    return {name: getattr(config, name) for name in names}


def train_drafter(
    shard_dir: Path,
    out_dir: Path,
    minutes: float = 10.0,
    max_depth: int = 8,
    batch_size: int = 256,
    lr: float = 1e-3,
    threads: int = 1,
    seed: int = 0,
    sets: bool = False,
    temperature_feature: bool = False,
    previous_feature: bool = False,
    corrected_feature: bool = False,
    init: Path | None = None,
    shape: tuple[int, int, int] = DEFAULT_SHAPE,
    force: bool = False,
) -> dict:
    """Train the order model (or the sets model) on trajectory shards for ``minutes``; save it with held-out metrics.

    ``init`` starts from a trained drafter folder (e.g. the previous target's) with the same inputs or fewer.
    ``shape`` = (width, layers, heads) of the model (default: the paper's 128, 3, 8, about 0.6M parameters); a
    smaller one costs less per round where the drafter's compute counts against a small target (a CPU).
    ``force`` replaces a drafter in ``out_dir`` and removes the fits made for it (``DRAFTER_FITS``; metrics["removed"]
    names them). Interrupted (Ctrl-C) after a step, the model so far is saved with ``metrics["interrupted"]`` set.
    """
    check_minutes(minutes)
    check_drafter_output(out_dir, init, force)
    if init is not None:
        check_warm_start(Path(init), sets)
    replaces = holds_drafter(out_dir) and not (init is not None and Path(init).resolve() == Path(out_dir).resolve())
    d_model, n_layers, n_heads = shape
    config = OrderModelConfig(
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        threshold_feature=sets,
        temperature_feature=temperature_feature,
        previous_feature=previous_feature,
        corrected_feature=corrected_feature,
    )
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = OrderModel(config) if init is None else warm_start(Path(init), config)
    paths = sorted(Path(shard_dir).glob("shard_*.npz"))
    if not paths:
        raise FileNotFoundError(f"no trajectory shards (shard_*.npz) in {shard_dir} (spot-dlm collect makes them)")
    data = load_shards(paths)
    if corrected_feature and "corrected" not in data:
        raise ValueError(f"{shard_dir} holds no corrected confidence: collect it with --neighbours")
    prompts = np.unique(data["prompt_id"])
    heldout_prompts = set(np.random.default_rng(seed).choice(prompts, size=max(1, len(prompts) // 10), replace=False))
    is_heldout = np.isin(data["prompt_id"], list(heldout_prompts))
    cum = np.concatenate([np.zeros((1, data["committed"].shape[1]), np.int32), np.cumsum(data["committed"], 0)])
    train_ex = build_examples(data, max_depth, np.flatnonzero(~is_heldout), sets)
    held_ex = build_examples(data, max_depth, np.flatnonzero(is_heldout), sets)
    check_examples(Path(shard_dir), len(prompts), train_ex, held_ex)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    start, step, loss_ema = time.time(), 0, None
    budget = minutes * 60
    interrupted = False
    try:
        with tqdm(total=int(budget), unit="s", desc="train drafter") as bar:
            while time.time() - start < budget:
                index = rng.integers(0, len(train_ex.row), size=batch_size)
                features, allowed, target = batch_tensors(data, cum, train_ex, index, model.config)
                progress = (time.time() - start) / budget
                for group in optimizer.param_groups:
                    group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * progress)))
                loss = objective_loss(model, features, allowed, target, sets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                step += 1
                loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
                bar.update(int(time.time() - start) - bar.n)
                bar.set_postfix(loss=f"{loss_ema:.3f}", step=step)
    except KeyboardInterrupt:
        if step == 0:
            raise KeyboardInterrupt(f"stopped before the first step; {out_dir} is as it was") from None
        interrupted = True
    accuracy = accuracy_by_depth(model, data, cum, held_ex, max_depth, sets)
    metrics = {
        "objective": "sets" if sets else "order",
        ("heldout_exact_set_accuracy_by_depth" if sets else "heldout_next_commit_accuracy_by_depth"): accuracy,
    }
    metrics["heldout_accuracy_by_temperature_and_depth"] = by_temperature(
        data, held_ex, lambda ex: accuracy_by_depth(model, data, cum, ex, max_depth, sets)
    )
    if not sets:
        metrics["heldout_naive_stale_confidence_accuracy_by_depth"] = naive_accuracy(data, cum, held_ex, max_depth)
        metrics["heldout_naive_accuracy_by_temperature_and_depth"] = by_temperature(
            data, held_ex, lambda ex: naive_accuracy(data, cum, ex, max_depth)
        )
    metrics |= {
        "train_examples": int(len(train_ex.row)),
        "heldout_examples": int(len(held_ex.row)),
        "steps": step,
        "parameters": sum(p.numel() for p in model.parameters()),
        "shards": str(shard_dir),
    }
    stale = held_fits(out_dir) if replaces else []
    metrics |= ({"interrupted": True} if interrupted else {}) | ({"removed": stale} if stale else {})
    save_order_model(model, out_dir, metrics)
    remove_fits(out_dir, stale)
    return metrics
