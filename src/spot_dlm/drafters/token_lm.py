"""Token guesses re-ranked by a small block-diffusion LM's change of belief.

The bigram correction (``drafters/neighbours.py``) sees only the two tokens beside a drafted position. A small
block-diffusion LM over the target's vocabulary sees the whole branch: scored on the stale state and on the node a
commit is drafted from, the difference of its log-probabilities is the evidence the branch's commits bring to each
stale guess, and by Bayes' rule it moves the target's stale belief the same way:

    y'(v) = y(v) + (1 / T) * ( w * (log q(v | node) - log q(v | stale state)) + w_b * bigram PMI )

with ``y`` the coupled score (``Z / T + gumbel``, or ``Z`` at T = 0; T reads as 1 there), the bigram term of
``drafters/neighbours.py`` when the drafter folder has a bigram table (the two see different evidence: the LM the
whole block and the text before it, the bigram 20M tokens of counts), and the weights fitted together on standard
decoding of training prompts (``spot-dlm fit-token-survival --token-lm``). The small LM reads the last ``window``
clean tokens before the block (prefilled once per block: the decode loop's block memo keeps its cache); it scores
each distinct node once per block (batched per call; the stale state is the node the previous round accepted,
scored then), never on the target's pass counter. As with the bigram, the guess stays a guess: acceptance is exact
state equality, so nothing here can change an output token.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from spot_dlm.drafters.neighbours import NeighbourTokens, StalePass, load_bigram
from spot_dlm.drafters.token_survival import TokenSurvival
from spot_dlm.models.checkpoint import CONFIG_FILE, TOKENIZER_FILE, TRAIN_LOG_FILE, TRAINING_STATE_FILE, WEIGHTS_FILE

TOKEN_LM_DIR = "token_lm"  # sub-folder of a drafter folder holding the small LM (built-in architecture)
TOKEN_LM_FIT_FILE = "token_survival_lm.json"  # its fitted weights and the survival of the corrected guesses
DEFAULT_WINDOW = 256
MEMO_BYTES = 64 * 2**20  # scored states a memo keeps; the least recently used go first


@dataclass(frozen=True)
class TokenLM:
    """A small block-diffusion LM over the target's vocabulary and the fitted weight of its correction, optionally
    added to the bigram's (``bigram``, with its own weights: the two see different evidence)."""

    model: object  # a Target (models/base.py): prefill + score, its own pass counter
    weight_greedy: float
    weight_sampled: float
    window: int = DEFAULT_WINDOW  # clean tokens before the block the small LM reads (at most its context less L)
    bigram: NeighbourTokens | None = None

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"token LM window must be >= 1, got {self.window}")

    def weight(self, temperature: float) -> float:
        return self.weight_sampled if temperature > 0 else self.weight_greedy

    def weights(self, temperature: float) -> tuple[float, ...]:
        """(LM weight,) or (LM weight, bigram weight)."""
        return (self.weight(temperature), *(() if self.bigram is None else self.bigram.weights(temperature)))

    def moved(self, stale: StalePass, states: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Every drafted node differs from the stale state somewhere: the LM may move any position."""
        return np.ones(len(positions), dtype=bool)

    def parts(
        self, stale: StalePass, parents: np.ndarray, positions: np.ndarray, candidates: np.ndarray
    ) -> np.ndarray:
        """[log q(v | parent) - log q(v | stale state), then the bigram's PMI if any] at each commit's position.
        parents int64 [C, L], positions [C], candidates int64 [C, R] -> float64 [K, C, R]"""
        stale_table, *tables = self._tables(stale, np.concatenate([stale.state.cpu().numpy()[None], parents]))
        now = np.stack([table[p] for table, p in zip(tables, positions, strict=True)])  # [C, V]
        now = np.take_along_axis(now, candidates, 1).astype(np.float64)  # [C, R]
        before = np.take_along_axis(stale_table[positions], candidates, 1).astype(np.float64)  # [C, R]
        known = np.isfinite(now) & np.isfinite(before)  # the mask token (a candidate in tiny vocabularies): none
        lm = np.where(known, now - np.where(known, before, 0.0), 0.0)[None]
        if self.bigram is None:
            return lm
        return np.concatenate([lm, self.bigram.parts(stale, parents, positions, candidates)])

    def _tables(self, stale: StalePass, states: np.ndarray) -> list[np.ndarray]:
        """float32 [L, V] log-probabilities for each state (int64 [C, L]); each distinct state is scored once while
        the memo keeps it (one batched small-LM pass for those not kept; at most ``MEMO_BYTES`` kept, least recently
        used dropped first: a block memo holds the accepted nodes that become the next rounds' stale states)."""
        table = stale.memo.setdefault("token_lm", {})  # state bytes -> float32 [L, V], least recently used first
        keys = [row.tobytes() for row in states]
        first = {}  # each state not kept -> its first row
        for row, key in enumerate(keys):
            if key in table:
                table[key] = table.pop(key)  # now the most recently used
            else:
                first.setdefault(key, row)
        if first:
            scored = self._score(stale, states[list(first.values())])  # [B, L, V]
            table.update(zip(first, scored, strict=True))
        found = [table[k] for k in keys]
        keep = max(len(found), MEMO_BYTES // found[0].nbytes)
        for key in list(table)[: max(len(table) - keep, 0)]:
            del table[key]
        return found

    def _score(self, stale: StalePass, states: np.ndarray) -> np.ndarray:
        """One small-LM pass over B block states after the prefix window -> float32 [B, L, V] log-probabilities
        (the mask token excluded)."""
        if stale.prefix is None:
            raise ValueError("the token LM reads the text before the block: this round carries no prefix")
        model = self.model
        cache = stale.memo.get("token_lm_prefix")
        if cache is None:  # the window, cut so that it and the block fit the small LM's context
            fits = min(self.window, model.max_length - states.shape[1])
            if fits < 1:
                raise ValueError(
                    f"a {states.shape[1]}-token block leaves no context in the token LM's {model.max_length}"
                )
            window = stale.prefix[-fits:].to(model.device)
            cache = stale.memo["token_lm_prefix"] = model.prefill(window)
        blocks = torch.from_numpy(states).to(model.device)
        logits = model.score(cache, blocks).logits.float()  # [B, L, V]
        logits[..., stale.mask_id] = float("-inf")
        return torch.log_softmax(logits, dim=-1).cpu().numpy()


def save_token_lm_fit(weights: tuple, survival: TokenSurvival, window: int, folder: Path) -> Path:
    """Write the fitted (greedy, sampled) weights, each an LM weight or (LM weight, bigram weight), the window and
    the survival of the corrected guesses."""
    path = Path(folder) / TOKEN_LM_FIT_FILE
    greedy, sampled = (tuple(np.atleast_1d(np.asarray(w, dtype=float)).tolist()) for w in weights)
    raw = {"weight_greedy": greedy[0], "weight_sampled": sampled[0], "window": window}
    if len(greedy) > 1:
        raw |= {"bigram_weight_greedy": greedy[1], "bigram_weight_sampled": sampled[1]}
    path.write_text(json.dumps(raw | json.loads(survival.to_json()), indent=2))
    return path


LM_FILES = (CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE)  # a small LM checkpoint (built-in architecture)
LM_RECORDS = (TRAINING_STATE_FILE, TRAIN_LOG_FILE)  # how it was trained, copied when the source has them


def install_token_lm(source: Path, folder: Path) -> Path:
    """Copy a small LM checkpoint (``LM_FILES``, and its ``LM_RECORDS`` when it has them) into a drafter folder's
    ``token_lm/``, replacing whatever LM was there (no record of it is left behind); returns that folder."""
    source, dest = Path(source), Path(folder) / TOKEN_LM_DIR
    if source.resolve() == dest.resolve():
        return dest
    for name in LM_FILES:
        if not (source / name).is_file():
            raise FileNotFoundError(f"token LM checkpoint {source} has no {name}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in LM_FILES + tuple(n for n in LM_RECORDS if (source / n).is_file()):
        shutil.copyfile(source / name, dest / name)
    return dest


def load_small_lm(folder: Path, target, device: str | torch.device = "cpu"):
    """A small LM checkpoint (built-in architecture) as a Target; ValueError when its vocabulary or mask token is
    not the target's."""
    from spot_dlm.models.builtin import load_builtin_target

    model, _ = load_builtin_target(folder, device=device)
    if model.vocab_size != target.vocab_size or model.mask_id != target.mask_id:
        raise ValueError(
            f"token LM {folder} has vocabulary {model.vocab_size} (mask {model.mask_id}); the target has "
            f"{target.vocab_size} (mask {target.mask_id})"
        )
    return model


def load_token_lm(folder: Path, target, device: str | torch.device = "cpu"):
    """``(TokenLM, TokenSurvival of the corrected guesses)`` from a drafter folder, or None when it has no token
    LM or no fit; ValueError when either is corrupt or the LM's vocabulary is not the target's."""
    folder = Path(folder)
    path = folder / TOKEN_LM_FIT_FILE
    if not path.is_file() or not (folder / TOKEN_LM_DIR).is_dir():
        return None
    try:
        raw = json.loads(path.read_text())
        weights = float(raw.pop("weight_greedy")), float(raw.pop("weight_sampled"))
        window = int(raw.pop("window"))
        bigram_weights = None
        if "bigram_weight_greedy" in raw:
            bigram_weights = float(raw.pop("bigram_weight_greedy")), float(raw.pop("bigram_weight_sampled"))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"invalid token LM fit {path}: {err}") from err
    survival = TokenSurvival.from_json(json.dumps(raw), str(path))
    bigram = None
    if bigram_weights is not None:
        table = load_bigram(folder, target.vocab_size)
        if table is None:
            raise ValueError(f"token LM fit {path} adds the bigram's correction but {folder} has no bigram table")
        bigram = NeighbourTokens(table, *bigram_weights)
    model = load_small_lm(folder / TOKEN_LM_DIR, target, device)
    return TokenLM(model, *weights, window=window, bigram=bigram), survival
