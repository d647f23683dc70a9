"""Neighbour-aware token guesses: re-rank a stale guess by the tokens committed beside it since the stale pass.

A drafted edge commits position j with a token guessed from the stale logits ``Z(s)``. Those logits were computed
while j's neighbours were still masked; by the time j commits, the free commit or the branch may have filled
j - 1 or j + 1, and the target's choice at j moves with them (on the built-in target at T = 0, one commit after the
stale pass: the stale guess survives 91% of the time when no neighbour changed, 75% when the left neighbour was
just committed, 62% when the right one was). The branch's own state says which tokens those neighbours now hold,
so the guess can condition on them by Bayes' rule, with a bigram model of the target's text standing in for the
missing factor:

    y'(v) = y(v) + (w / T) * ( [left fresh] PMI(left, v) + [right fresh] PMI(v, right) )

where ``y`` is the coupled score (``Z / T + gumbel``, or ``Z`` at T = 0; T reads as 1 there), ``PMI(a, b)`` the
pointwise mutual information of the bigram (a, b) in the training corpus, and ``w`` a weight fitted on standard
decoding of training prompts (``spot-dlm fit-token-survival``). Only the ``CANDIDATES`` best stale guesses are
re-ranked, so the table is read at a few (neighbour, candidate) pairs and stays sparse for any vocabulary.

The guess stays a guess: acceptance is still exact state equality, so nothing here can change an output token.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from safetensors.numpy import save_file

from spot_dlm.models.checkpoint import load_weights

BIGRAM_FILE = "bigram.safetensors"
CANDIDATES = 16  # stale guesses re-ranked per drafted position
DEFAULT_SMOOTHING = 0.1


@dataclass(frozen=True)
class BigramTable:
    """Sparse bigram counts of a token stream and the smoothed PMI they define.

    ``keys`` holds ``a * vocab_size + b`` for every observed bigram (a then b), sorted; ``counts`` their counts.
    """

    vocab_size: int
    keys: np.ndarray  # int64 [E], sorted, unique
    counts: np.ndarray  # float64 [E], > 0
    left_totals: np.ndarray  # float64 [V]: bigrams starting with each token
    right_totals: np.ndarray  # float64 [V]: bigrams ending with each token
    smoothing: float = DEFAULT_SMOOTHING

    def __post_init__(self) -> None:
        v = self.vocab_size
        if v < 2:
            raise ValueError(f"bigram vocab size must be >= 2, got {v}")
        if self.keys.ndim != 1 or self.keys.shape != self.counts.shape:
            raise ValueError("bigram keys and counts must be 1-D arrays of one length")
        if self.left_totals.shape != (v,) or self.right_totals.shape != (v,):
            raise ValueError(f"bigram totals must have {v} entries")
        if len(self.keys) and (self.keys[0] < 0 or self.keys[-1] >= v * v or np.any(np.diff(self.keys) <= 0)):
            raise ValueError("bigram keys must be sorted, unique and inside the vocabulary")
        if np.any(self.counts <= 0) or not self.smoothing > 0:
            raise ValueError("bigram counts and smoothing must be positive")

    @classmethod
    def from_stream(cls, stream: np.ndarray, vocab_size: int, smoothing: float = DEFAULT_SMOOTHING) -> BigramTable:
        """Count the bigrams of a token stream (int [N], every id < vocab_size)."""
        stream = np.asarray(stream, dtype=np.int64)
        if len(stream) < 2:
            raise ValueError("a bigram table needs a stream of at least two tokens")
        if stream.min() < 0 or stream.max() >= vocab_size:
            raise ValueError(f"token ids outside the vocabulary of {vocab_size}")
        keys, counts = np.unique(stream[:-1] * vocab_size + stream[1:], return_counts=True)
        left = np.bincount(stream[:-1], minlength=vocab_size).astype(np.float64)
        right = np.bincount(stream[1:], minlength=vocab_size).astype(np.float64)
        return cls(vocab_size, keys, counts.astype(np.float64), left, right, smoothing)

    def count(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Counts of the bigrams (a, b), broadcast. int arrays -> float64"""
        query = np.asarray(a, dtype=np.int64) * self.vocab_size + np.asarray(b, dtype=np.int64)
        index = np.minimum(np.searchsorted(self.keys, query), max(len(self.keys) - 1, 0))
        found = self.keys[index] == query if len(self.keys) else np.zeros(query.shape, dtype=bool)
        return np.where(found, self.counts[index] if len(self.keys) else 0.0, 0.0)

    def pmi(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Smoothed log p(a, b) / (p(a, .) p(., b)), broadcast over int arrays -> float64 (add-``smoothing`` on
        every one of the V^2 bigrams)."""
        alpha, v = self.smoothing, self.vocab_size
        total = float(self.left_totals.sum()) + alpha * v * v
        joint = self.count(a, b) + alpha
        left = self.left_totals[np.asarray(a)] + alpha * v
        right = self.right_totals[np.asarray(b)] + alpha * v
        return np.log(joint) + np.log(total) - np.log(left) - np.log(right)


def save_bigram(table: BigramTable, folder: Path, source: dict | None = None) -> Path:
    """Write ``bigram.safetensors`` (counts as float32, no pickle) into a drafter folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / BIGRAM_FILE
    arrays = {
        "keys": table.keys.astype(np.int64),
        "counts": table.counts.astype(np.float32),
        "left_totals": table.left_totals.astype(np.float32),
        "right_totals": table.right_totals.astype(np.float32),
    }
    meta = {"vocab_size": str(table.vocab_size), "smoothing": repr(table.smoothing)}
    meta["source"] = json.dumps(source or {})
    save_file(arrays, str(path), metadata=meta)
    return path


def load_bigram(folder: Path, vocab_size: int | None = None) -> BigramTable | None:
    """The table stored in a drafter folder (None when it has none); ValueError when it is corrupt or was counted
    with another vocabulary than ``vocab_size``."""
    path = Path(folder) / BIGRAM_FILE
    if not path.is_file():
        return None
    from safetensors import safe_open

    arrays = {name: tensor.numpy() for name, tensor in load_weights(path).items()}
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        stored_vocab, smoothing = int(meta["vocab_size"]), float(meta["smoothing"])
        table = BigramTable(
            stored_vocab,
            arrays["keys"].astype(np.int64),
            arrays["counts"].astype(np.float64),
            arrays["left_totals"].astype(np.float64),
            arrays["right_totals"].astype(np.float64),
            smoothing,
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"invalid bigram table {path}: {err}") from err
    if vocab_size is not None and stored_vocab != vocab_size:
        raise ValueError(f"bigram table {path} was counted over {stored_vocab} tokens; the target has {vocab_size}")
    return table


@dataclass
class StalePass:
    """What a token correction reads of one stale pass: its state, the rule's temperature, the clean text before the
    block (a small LM's context) and a memo for what it computes once per pass (callers may share one memo between
    the stale passes of a block: nothing in it depends on the stale state itself)."""

    state: torch.Tensor  # int64 [L]: the stale state
    mask_id: int
    prefix: torch.Tensor | None = None  # int64 [P]: prompt and finished blocks (None: not known)
    temperature: float = 0.0
    memo: dict = field(default_factory=dict)

    @functools.cached_property
    def stale_masked(self) -> np.ndarray:
        """bool [L] on the host: the positions masked in the stale state (a neighbour filled since is "fresh")."""
        return (self.state == self.mask_id).cpu().numpy()


class TokenCorrection(Protocol):
    """Re-ranks stale guesses by what a branch committed since the stale pass: ``y'(v) = y(v) + (1 / T) c(v)`` with
    ``c = sum_k w_k c_k``, K parts each with a fitted weight per temperature kind (``weighted_correction``)."""

    def weights(self, temperature: float) -> tuple[float, ...]:
        """w_k for each part (greedy weights at T = 0, sampled ones above)."""

    def moved(self, stale: StalePass, states: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Which (state, position) pairs may be corrected at all. states int64 [M, L], positions [M] -> bool [M]"""

    def parts(
        self, stale: StalePass, parents: np.ndarray, positions: np.ndarray, candidates: np.ndarray
    ) -> np.ndarray:
        """c_k(v) for the candidates of commits made from ``parents`` (int64 [C, L] on the host) at ``positions``
        ([C]). candidates int64 [C, R] -> float64 [K, C, R]"""


def weighted_correction(
    corrector: TokenCorrection, stale: StalePass, parents: np.ndarray, positions: np.ndarray, candidates: np.ndarray
) -> np.ndarray:
    """c(v) = sum_k w_k c_k(v) in nats, at the stale pass's temperature. -> float64 [C, R]"""
    weights = np.asarray(corrector.weights(stale.temperature), dtype=np.float64)  # [K]
    return np.tensordot(weights, corrector.parts(stale, parents, positions, candidates), axes=1)


def is_active(corrector: TokenCorrection | None, temperature: float) -> bool:
    """Does the correction change anything at this temperature (some weight non-zero)?"""
    return corrector is not None and any(w != 0 for w in corrector.weights(temperature))


@dataclass(frozen=True)
class NeighbourTokens:
    """The bigram table with the fitted weight of its correction per temperature kind (0: stale guesses)."""

    table: BigramTable
    weight_greedy: float
    weight_sampled: float

    def weight(self, temperature: float) -> float:
        return self.weight_sampled if temperature > 0 else self.weight_greedy

    def weights(self, temperature: float) -> tuple[float, ...]:
        return (self.weight(temperature),)

    def moved(self, stale: StalePass, states: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Only a position whose left or right neighbour was filled since the stale pass has a bigram correction."""
        fresh = fresh_neighbours(states, positions, stale.stale_masked, stale.mask_id)
        return fresh[0] | fresh[2]

    def parts(
        self, stale: StalePass, parents: np.ndarray, positions: np.ndarray, candidates: np.ndarray
    ) -> np.ndarray:
        fresh = fresh_neighbours(parents, positions, stale.stale_masked, stale.mask_id)
        return neighbour_correction(self.table, candidates, *fresh)[None]  # [1, C, R]


def fresh_neighbours(
    parents: np.ndarray, positions: np.ndarray, stale_masked: np.ndarray, mask_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Which neighbours of each drafted position were committed after the stale pass, and their tokens.

    parents int64 [C, L]: the state each commit is made from; positions int64 [C]; stale_masked bool [L].
    Returns (left_fresh bool [C], left_token int64 [C], right_fresh bool [C], right_token int64 [C]); a token is
    only meaningful where its flag holds.
    """
    length = parents.shape[1]
    rows = np.arange(len(positions))
    left = np.maximum(positions - 1, 0)
    right = np.minimum(positions + 1, length - 1)
    left_token, right_token = parents[rows, left], parents[rows, right]
    left_fresh = (positions > 0) & stale_masked[left] & (left_token != mask_id)
    right_fresh = (positions < length - 1) & stale_masked[right] & (right_token != mask_id)
    return left_fresh, left_token, right_fresh, right_token


def neighbour_correction(
    table: BigramTable,
    candidates: np.ndarray,
    left_fresh: np.ndarray,
    left_token: np.ndarray,
    right_fresh: np.ndarray,
    right_token: np.ndarray,
) -> np.ndarray:
    """PMI of each candidate with its fresh neighbours. candidates int64 [C, R]; flags/tokens [C] -> float64 [C, R]"""
    correction = np.zeros(candidates.shape, dtype=np.float64)
    if left_fresh.any():
        rows = np.flatnonzero(left_fresh)
        correction[rows] += table.pmi(left_token[rows, None], candidates[rows])
    if right_fresh.any():
        rows = np.flatnonzero(right_fresh)
        correction[rows] += table.pmi(candidates[rows], right_token[rows, None])
    return correction


def rerank(scores: np.ndarray, candidates: np.ndarray, correction: np.ndarray, scale: float, n: int):
    """The n best candidates per row after adding ``scale * correction`` (ties: the stale order).

    scores float64 [C, R] (best first), candidates int64 [C, R] -> (tokens int64 [n, C], scores float64 [n, C])"""
    corrected = scores + scale * correction  # [C, R]
    order = np.argsort(-corrected, axis=1, kind="stable")[:, :n]  # [C, n]
    return np.take_along_axis(candidates, order, 1).T, np.take_along_axis(corrected, order, 1).T


def candidate_scores(coupled: torch.Tensor, rank0: torch.Tensor, positions: np.ndarray, count: int):
    """The ``count`` best coupled guesses at some positions, the rule's own choice first (it breaks ties by the
    lowest token id, ``topk`` may not). Runs where ``coupled`` lives; only [C, R] comes to the host.

    coupled float64 [L, V] (coupled scores of every stale-masked row), rank0 int64 [L] (the rule's coupled token),
    positions int64 [C] -> (scores float64 [C, R], tokens int64 [C, R])"""
    rows = coupled[torch.from_numpy(positions).to(coupled.device)]  # [C, V]
    tokens = rows.topk(min(count, rows.shape[-1]), dim=-1).indices.cpu().numpy()  # [C, R]
    tokens = rule_first(tokens, rank0.cpu().numpy()[positions])
    return rows.gather(1, torch.from_numpy(tokens).to(rows.device)).cpu().numpy(), tokens


def rule_first(tokens: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Best guesses with the rule's own choice at rank 0: ``topk`` may order tied scores otherwise (the rule takes
    the lowest token id). tokens int64 [C, R] best first, first int64 [C] -> tokens, changed in place"""
    for row in np.flatnonzero(tokens[:, 0] != first):  # ties only
        at = np.flatnonzero(tokens[row] == first[row])
        if len(at):
            tokens[row, at[0]] = tokens[row, 0]
        tokens[row, 0] = first[row]
    return tokens


NEIGHBOUR_FIT_FILE = "token_survival_neighbours.json"


def save_neighbour_fit(weights: tuple[float, float], survival, folder: Path) -> Path:
    """Write the fitted (greedy, sampled) weights and the survival of the corrected guesses beside a bigram table."""
    path = Path(folder) / NEIGHBOUR_FIT_FILE
    raw = {"weight_greedy": weights[0], "weight_sampled": weights[1], **json.loads(survival.to_json())}
    path.write_text(json.dumps(raw, indent=2))
    return path


def load_neighbour_fit(folder: Path, vocab_size: int | None = None):
    """``(NeighbourTokens, TokenSurvival of the corrected guesses)`` from a drafter folder, or None when it lacks the
    bigram table or its fit; ValueError when either is corrupt or does not fit the vocabulary."""
    from spot_dlm.drafters.token_survival import TokenSurvival

    path = Path(folder) / NEIGHBOUR_FIT_FILE
    if not path.is_file() or not (Path(folder) / BIGRAM_FILE).is_file():
        return None
    table = load_bigram(folder, vocab_size)
    try:
        raw = json.loads(path.read_text())
        weights = float(raw.pop("weight_greedy")), float(raw.pop("weight_sampled"))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"invalid neighbour fit {path}: {err}") from err
    if not all(np.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"invalid neighbour fit {path}: weights must be finite and >= 0, got {weights}")
    survival = TokenSurvival.from_json(json.dumps(raw), str(path))
    return NeighbourTokens(table, *weights), survival
