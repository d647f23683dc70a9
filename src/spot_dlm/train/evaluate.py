"""Evaluate a target checkpoint: held-out NELBO, answer accuracy, well-formedness and stale-token agreement.

Stale-token agreement: among positions committed by standard decoding at T = 0, the fraction whose token equals
the argmax of the *previous* pass at that position (the stale guess a drafter would make). Positions committed by
a block's first pass have no previous pass in the block and are not counted. Real DLMs: 92-100%.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from spot_dlm.api import GenerateConfig, encode_prompt
from spot_dlm.decode import NoDrafter, StepRecord, decode_ids
from spot_dlm.noise import NoiseKey
from spot_dlm.tasks import is_correct
from spot_dlm.train.losses import block_diffusion_loss

WELL_FORMED = re.compile(r"####\s*-?[\d,]*\.?\d+\s*$")


@dataclass
class AgreementCounter:
    """Observer counting stale-token agreement (and split by digit / other tokens)."""

    mask_id: int
    digit_ids: frozenset[int]
    agree: int = 0
    total: int = 0
    digit_agree: int = 0
    digit_total: int = 0
    _previous: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> argmax of the previous pass

    def __call__(self, record: StepRecord) -> None:
        z = record.logits.to(torch.float64).clone()
        z[:, self.mask_id] = float("-inf")
        current = z.argmax(-1)
        previous = self._previous.get(record.block_index)
        if previous is not None:
            committed = (record.state == self.mask_id) & (record.next_state != self.mask_id)
            for position in torch.nonzero(committed).flatten().tolist():
                token = int(record.next_state[position])
                hit = int(previous[position]) == token
                self.agree += hit
                self.total += 1
                if token in self.digit_ids:
                    self.digit_agree += hit
                    self.digit_total += 1
        self._previous = {record.block_index: current}

    def summary(self) -> dict:
        words = self.total - self.digit_total
        return {
            "stale_agreement": self.agree / self.total if self.total else None,
            "stale_agreement_digits": self.digit_agree / self.digit_total if self.digit_total else None,
            "stale_agreement_other": (self.agree - self.digit_agree) / words if words else None,
            "counted_commits": self.total,
        }


def digit_token_ids(codec) -> frozenset[int]:
    return frozenset(codec.encode(str(d))[0] for d in range(10))


def decode_report(target, codec, items: list[dict], block_length: int, gen_length: int, seed: int = 0) -> dict:
    """Standard decoding at T = 0: accuracy, well-formed rate, stale agreement, and the generations."""
    config = GenerateConfig(method="standard", block_length=block_length, gen_length=gen_length, seed=seed)
    settings = config.settings()
    counter = AgreementCounter(target.mask_id, digit_token_ids(codec))
    texts, correct, well_formed, degenerate = [], [], [], []
    for index, item in enumerate(tqdm(items, desc=f"evaluate L={block_length}")):
        ids = encode_prompt(item["question"], codec, config, target)
        raw = decode_ids(target, ids, settings, NoDrafter(), NoiseKey(seed, index), observer=counter)
        tokens = raw.token_ids.tolist()
        ended = target.eos_id in tokens
        text = codec.decode(tokens[: tokens.index(target.eos_id)] if ended else tokens)
        texts.append(text)
        correct.append(bool(is_correct(text, item.get("answer"))))
        well_formed.append(ended and bool(WELL_FORMED.search(text.strip())))
        degenerate.append(is_degenerate(text))
    return {
        "n": len(items),
        "block_length": block_length,
        "accuracy": float(np.mean(correct)),
        "well_formed": float(np.mean(well_formed)),
        "degenerate": float(np.mean(degenerate)),
        **counter.summary(),
        "samples": [{"question": it["question"], "generation": t} for it, t in zip(items[:3], texts[:3])],
    }


LONG_CHARACTER_RUN = re.compile(r"(.)\1{19,}")  # one character 20 times or more in a row ("0000...")


def is_degenerate(text: str) -> bool:
    """A generation that repeats one short line, a few words, or one character over and over."""
    if LONG_CHARACTER_RUN.search(text):
        return True
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) >= 4 and len(set(lines)) <= len(lines) // 3:
        return True
    words = text.split()
    return len(words) >= 12 and len(set(words)) <= 3


@torch.no_grad()
def heldout_nelbo(model, tokens: np.ndarray, block_length: int, n_windows: int = 64, seq_len: int = 256) -> float:
    """Negative ELBO per token (nats) of block diffusion on held-out windows, fixed masks."""
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    starts = rng.integers(0, len(tokens) - seq_len, size=n_windows)
    total = 0.0
    for chunk in np.array_split(starts, max(1, n_windows // 16)):
        batch = torch.from_numpy(np.stack([tokens[s : s + seq_len] for s in chunk]).astype(np.int64))
        total += float(block_diffusion_loss(model, batch, block_length, generator, nelbo=True).loss) * len(chunk)
    return total / n_windows
