"""Train the built-in target: autoregressive pretraining, then block-diffusion fine-tuning (the SDAR recipe).

Every run is resumable: it starts from the checkpoint in ``out_dir`` when one exists (weights in 16 bits, the
optimizer rebuilt with a short warm-up), snapshots every few minutes, and logs held-out loss to
``train_log.jsonl``. The learning rate follows warm-up then cosine decay over the run's wall-clock budget.

Before anything is written the run is checked: a checkpoint it continues must share the corpus's tokenizer and
must not go back from the block-diffusion phase to the autoregressive one, and a checkpoint in ``out_dir`` is only
replaced by a new model with ``force``. Ctrl-C saves a snapshot of the steps done.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from spot_dlm.models.checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    TRAIN_LOG_FILE,
    WEIGHTS_FILE,
    load_model,
    load_training_state,
    save_checkpoint,
)
from spot_dlm.models.tokenizer import TextCodec
from spot_dlm.models.transformer import BlockDiffusionLM, ModelConfig, keep_layers
from spot_dlm.safety import check_minutes, check_writable_parent, write_text_atomic
from spot_dlm.train.losses import LossOutput, autoregressive_loss, block_diffusion_loss

PHASES = ("ar", "bd")
CORPUS_FILES = (TOKENIZER_FILE, "train_tokens.npy", "heldout_tokens.npy")


@dataclass(frozen=True)
class TrainConfig:
    out_dir: Path
    corpus_dir: Path
    phase: str = "ar"  # "ar": autoregressive pretraining; "bd": block-diffusion fine-tune
    minutes: float = 60.0
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    block_lengths: tuple[int, ...] = (4, 8, 16, 32)
    snapshot_minutes: float = 10.0
    eval_batches: int = 8
    threads: int = 2
    seed: int = 0
    d_model: int = 256
    n_layers: int = 6
    n_heads: int = 4
    init_from: Path | None = None  # a checkpoint folder to start from when out_dir holds none (e.g. the shipped one)
    device: str = "cpu"  # cpu, cuda, cuda:N or auto
    bf16: bool = False  # bfloat16 autocast for the forward and loss (weights and optimizer stay float32)
    teacher: Path | None = None  # bd phase: distil this trained model's distributions instead of the clean tokens
    keep_layers: tuple[int, ...] | None = None  # start from these layers of init_from only (a layer-dropped student)
    force: bool = False  # replace a checkpoint in out_dir with a new model (or init_from's) instead of resuming it

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; choose one of {PHASES}")
        check_minutes(self.minutes)
        if not self.snapshot_minutes >= 0:  # also rejects NaN
            raise ValueError(f"--snapshot-minutes must be >= 0, got {self.snapshot_minutes}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if min(self.batch_size, self.threads, self.seq_len) < 1:
            raise ValueError("batch size, threads and sequence length must be >= 1")
        bad = [b for b in self.block_lengths if self.seq_len % b]
        if bad:
            raise ValueError(f"block lengths {bad} do not divide seq_len {self.seq_len}")
        if self.teacher is not None and self.phase != "bd":
            raise ValueError("a teacher is distilled in the block-diffusion phase only (--phase bd)")
        if self.keep_layers is not None and self.init_from is None:
            raise ValueError("keep_layers picks layers of the --init checkpoint: give one")


def copy_atomic(source: Path, destination: Path) -> None:
    """Copy a file under a temporary name, then rename it into place."""
    tmp = destination.with_name(destination.name + ".tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, destination)


def learning_rate(config: TrainConfig, step: int, elapsed: float) -> float:
    """Linear warm-up over steps, then cosine over the run's wall-clock budget down to min_lr_ratio * lr."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, elapsed / (config.minutes * 60.0))
    ratio = config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return config.lr * ratio


def phase_loss(
    model: BlockDiffusionLM,
    batch: torch.Tensor,
    phase: str,
    block_length: int,
    generator: torch.Generator,
    teacher: BlockDiffusionLM | None = None,
) -> LossOutput:
    if phase == "ar":
        return autoregressive_loss(model, batch)
    return block_diffusion_loss(model, batch, block_length, generator, teacher=teacher)


def fixed_eval_batches(tokens: np.ndarray, config: TrainConfig) -> list[torch.Tensor]:
    """Deterministic held-out windows so every evaluation sees the same text."""
    rng = np.random.default_rng(12345)
    starts = rng.integers(0, len(tokens) - config.seq_len, size=(config.eval_batches, config.batch_size))
    return [
        torch.from_numpy(np.stack([tokens[s : s + config.seq_len] for s in row]).astype(np.int64)) for row in starts
    ]


def model_device(model: BlockDiffusionLM) -> torch.device:
    return model.embed.weight.device


@torch.no_grad()
def heldout_loss(
    model: BlockDiffusionLM, batches: list[torch.Tensor], phase: str, teacher: BlockDiffusionLM | None = None
) -> float:
    """Mean held-out loss per predicted token (AR NLL, or block-diffusion masked CE at block 16, fixed masks; with
    a ``teacher``, the soft cross-entropy to its distributions instead). Always in float32, so runs with and
    without bf16 autocast are compared on the same footing."""
    model.eval()
    device = model_device(model)
    generator = torch.Generator(device=device).manual_seed(777)
    total, count = 0.0, 0
    for batch in batches:
        out = phase_loss(model, batch.to(device), phase, 16, generator, teacher)
        total += float(out.loss) * out.n_tokens
        count += out.n_tokens
    model.train()
    return total / max(count, 1)


def resumes(config: TrainConfig) -> bool:
    """Does the run continue the checkpoint in out_dir? (Yes when it holds one, unless ``force``.)"""
    return (Path(config.out_dir) / WEIGHTS_FILE).is_file() and not config.force


def starting_checkpoint(config: TrainConfig) -> Path | None:
    """The checkpoint a run starts from: out_dir's (resumed), else init_from's; None: a new model."""
    if resumes(config):
        return Path(config.out_dir)
    return None if config.init_from is None else Path(config.init_from)


def check_corpus(corpus: Path) -> None:
    missing = [name for name in CORPUS_FILES if not (Path(corpus) / name).is_file()]
    if missing:
        raise FileNotFoundError(f"corpus {corpus} lacks {', '.join(missing)} (spot-dlm prepare-data makes them)")


def check_same_tokenizer(folder: Path, codec: TextCodec, corpus: Path, hint: str = "") -> None:
    """The checkpoint in ``folder`` was trained with the corpus's tokenizer (the same vocabulary), else ValueError."""
    path = folder / TOKENIZER_FILE
    if path.is_file():
        theirs = TextCodec.from_file(path)
        same = theirs.tokenizer.get_vocab(with_added_tokens=True) == codec.tokenizer.get_vocab(with_added_tokens=True)
        size = theirs.vocab_size
    else:
        size = ModelConfig.from_file(folder / CONFIG_FILE).vocab_size
        same = size == codec.vocab_size
    if not same:
        raise ValueError(
            f"the checkpoint in {folder} was trained with another tokenizer ({size} tokens) than the corpus {corpus} "
            f"({codec.vocab_size} tokens){hint}"
        )


def check_phase(folder: Path, phase: str, hint: str = "") -> None:
    """A block-diffusion checkpoint is not trained autoregressively again (the default phase is ar)."""
    if load_training_state(folder).get("last_phase") == "bd" and phase == "ar":
        raise ValueError(
            f"the checkpoint in {folder} was last trained in the block-diffusion phase; --phase ar would train it "
            f"autoregressively again: give --phase bd to continue it{hint}"
        )


def check_start(config: TrainConfig, codec: TextCodec) -> None:
    """Everything a run needs, checked before it writes anything: the output folder, where the model starts from
    (its tokenizer and phase) and the teacher."""
    out, init = Path(config.out_dir), config.init_from
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    check_writable_parent(out / TOKENIZER_FILE, "--out")
    if init is not None and not (Path(init) / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"--init: no checkpoint in {init}")
    other_start = (init is not None and Path(init).resolve() != out.resolve()) or config.keep_layers is not None
    if resumes(config) and other_start:
        raise ValueError(
            f"--out {out} already holds a checkpoint: leave out --init and --keep-layers to resume it, give --force "
            "to replace it with the model they make, or give another --out"
        )
    source = starting_checkpoint(config)
    hint = ", or --force to replace it with a new model" if resumes(config) else ""
    if source is not None:
        check_same_tokenizer(source, codec, Path(config.corpus_dir), hint)
        if config.keep_layers is None:
            check_phase(source, config.phase, hint)
    if config.teacher is not None:
        check_teacher(Path(config.teacher), codec.vocab_size)


def check_teacher(folder: Path, vocab_size: int) -> None:
    """The model to distil exists and shares the student's vocabulary (the corpus tokenizer's)."""
    if not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(f"teacher checkpoint not found: {folder / WEIGHTS_FILE}")
    size = ModelConfig.from_file(folder / CONFIG_FILE).vocab_size
    if size != vocab_size:
        raise ValueError(
            f"the teacher in {folder} has a vocabulary of {size} tokens; the corpus tokenizer has {vocab_size}"
        )


def initial_model(config: TrainConfig, vocab_size: int) -> tuple[BlockDiffusionLM, dict]:
    """Resume from out_dir when it holds a checkpoint (unless ``force``); else from init_from (only its
    ``keep_layers``, if given, and then as a new run); else a fresh model."""
    out_dir = Path(config.out_dir)
    if resumes(config):
        return load_model(out_dir, dtype=torch.float32).train(), load_training_state(out_dir)
    init_dir = None if config.init_from is None else Path(config.init_from)
    if init_dir is not None and (init_dir / WEIGHTS_FILE).is_file():
        model = load_model(init_dir, dtype=torch.float32)
        if config.keep_layers is not None:
            return keep_layers(model, config.keep_layers).train(), {}
        return model.train(), load_training_state(init_dir)
    model_config = ModelConfig(
        vocab_size=vocab_size, d_model=config.d_model, n_layers=config.n_layers, n_heads=config.n_heads
    )
    return BlockDiffusionLM(model_config).train(), {}


def load_teacher(folder: Path, vocab_size: int, device: torch.device) -> BlockDiffusionLM:
    """The model to distil, frozen; it must share the student's vocabulary (its tokenizer's)."""
    if not (Path(folder) / "model.safetensors").is_file():
        raise FileNotFoundError(f"teacher checkpoint not found: {Path(folder) / 'model.safetensors'}")
    teacher = load_model(Path(folder), dtype=torch.float32)
    if teacher.config.vocab_size != vocab_size:
        raise ValueError(
            f"the teacher in {folder} has a vocabulary of {teacher.config.vocab_size} tokens; the corpus tokenizer "
            f"has {vocab_size}"
        )
    return teacher.to(device).eval().requires_grad_(False)


def train_target(config: TrainConfig) -> Path:
    """Run one resumable training phase for ``config.minutes`` minutes; returns the checkpoint folder."""
    from spot_dlm.api import resolve_device
    from spot_dlm.train.data import pack_batches

    device = resolve_device(config.device)
    corpus = Path(config.corpus_dir)
    check_corpus(corpus)
    codec = TextCodec.from_file(corpus / TOKENIZER_FILE)
    check_start(config, codec)
    replacing = (Path(config.out_dir) / WEIGHTS_FILE).is_file() and config.force  # its log starts anew
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    train_tokens = np.load(corpus / "train_tokens.npy")
    eval_batches = fixed_eval_batches(np.load(corpus / "heldout_tokens.npy"), config)

    model, state = initial_model(config, codec.vocab_size)
    model = model.to(device)
    teacher = None if config.teacher is None else load_teacher(config.teacher, codec.vocab_size, device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    run_seed = config.seed + int(state.get("runs", 0))
    batches = pack_batches(train_tokens, config.seq_len, config.batch_size, np.random.default_rng(run_seed))
    generator = torch.Generator(device=device).manual_seed(run_seed)
    tokens_seen = dict(state.get("tokens_seen", {"ar": 0, "bd": 0}))
    seconds = dict(state.get("seconds", {"ar": 0.0, "bd": 0.0}))
    log_path = Path(config.out_dir) / TRAIN_LOG_FILE
    fresh_log = [replacing]  # the first snapshot of a run that replaces a checkpoint writes a new log

    def snapshot(step: int, loss_ema: float, elapsed: float) -> None:
        held = heldout_loss(model, eval_batches, config.phase)
        taught = {} if teacher is None else {"heldout_teacher_loss": heldout_loss(model, eval_batches, "bd", teacher)}
        record = {
            "phase": config.phase,
            "step": step,
            "tokens_seen": tokens_seen,
            "seconds": seconds,
            "train_loss_ema": loss_ema,
            f"heldout_{config.phase}_loss": held,
            **taught,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        Path(config.out_dir).mkdir(parents=True, exist_ok=True)
        if fresh_log[0]:
            write_text_atomic(log_path, json.dumps(record) + "\n")
            fresh_log[0] = False
        else:
            with log_path.open("a") as log:
                log.write(json.dumps(record) + "\n")
        new_state = {
            "runs": int(state.get("runs", 0)) + 1,
            "tokens_seen": tokens_seen,
            "seconds": seconds,
            "last_phase": config.phase,
            "last_heldout": {**state.get("last_heldout", {}), config.phase: held},
            "train_config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        }
        save_checkpoint(model, config.out_dir, new_state)
        copy_atomic(corpus / TOKENIZER_FILE, Path(config.out_dir) / TOKENIZER_FILE)
        tqdm.write(f"[snapshot] step {step} {config.phase} held-out loss {held:.3f} ({elapsed / 60:.1f} min)")

    start = time.time()
    last_snapshot = start
    step, loss_ema = 0, float("nan")
    budget = config.minutes * 60.0
    try:
        with tqdm(total=int(budget), unit="s", desc=f"train {config.phase}") as bar:
            while (elapsed := time.time() - start) < budget:
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(config, step, elapsed)
                batch = torch.from_numpy(next(batches)).to(device)
                block_length = config.block_lengths[step % len(config.block_lengths)]
                tick = time.time()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
                    out = phase_loss(model, batch, config.phase, block_length, generator, teacher)
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                step += 1
                tokens_seen[config.phase] += batch.numel()
                seconds[config.phase] += time.time() - tick
                value = float(out.loss.detach())
                loss_ema = value if math.isnan(loss_ema) else 0.98 * loss_ema + 0.02 * value
                bar.update(int(time.time() - start) - bar.n)
                bar.set_postfix(loss=f"{loss_ema:.3f}", step=step, lr=f"{optimizer.param_groups[0]['lr']:.1e}")
                if time.time() - last_snapshot >= config.snapshot_minutes * 60.0:
                    snapshot(step, loss_ema, time.time() - start)
                    last_snapshot = time.time()
    except KeyboardInterrupt:
        if step == 0:
            raise KeyboardInterrupt(f"stopped before the first step; {config.out_dir} is as it was") from None
        snapshot(step, loss_ema, time.time() - start)
        raise KeyboardInterrupt(f"saved a snapshot of step {step} in {config.out_dir}") from None
    snapshot(step, loss_ema, time.time() - start)
    return config.out_dir
