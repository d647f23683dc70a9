"""The commit rules of real DLM families, as their authors' loops decide a pass, over K block states.

The built-in target's rule (``rules.step``) decides in float64 with the mask token removed. A real family's standard
loop is its authors' loop, so here each pass is decided with the authors' numerics: the softmax in the logits'
dtype with the mask token left in it, the token and the positions chosen by ``argmax`` / ``max`` / ``torch.topk``
called as the authors call them (same row width, same ``k``: that fixes the tie order), and the per-pass commit
count from the authors' schedule, indexed by the pass number inside the block (the rule-step index). The family's
standard loop and the speculative verifier call the same ``step``, so speculative decoding stays exact.

T > 0: the authors draw from torch's global RNG (``multinomial``, ``Categorical``, ``rand_like``); no loop can
reproduce those sample paths. Here a token is the Gumbel-max of the same filtered, tempered logits under the keyed
noise: the same distribution, and the same sample for the standard loop and every speculative method.

A committed mask token leaves its position masked, as in the authors' loops. When that leaves a block with masks after
its schedule's last pass, the authors carry them into later passes or blocks; that path is not reproduced: the loop
raises ``MaskTokenChosen`` (``decode.decode_block``). Off the true path (drafted states) a rule is total: a pass past
the schedule commits nothing.

Every family's rule is here, side by side (a module longer than most): their small differences (tempering, filters,
dtype, schedules) are the point, and reading them together is how they are checked against the authors' loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spot_dlm.rules import Proposal, StepResult

FAMILY_RULES = ("sdar", "llada", "dream", "fast_dllm_v2")
DREAM_CONFIDENCES = ("entropy", "maskgit_plus", "topk_margin")


class MaskTokenChosen(ValueError):
    """The rule would commit the mask token itself (the authors' loops then leave the position masked)."""


@dataclass(frozen=True)
class Window:
    """Where a block sits in the row the authors rank positions over (LLaDA and Dream rank over the whole canvas)."""

    offset: int = 0  # the block's first column in that row
    width: int = 0  # the row's length; 0: the block itself


def linear_schedule(masks: int, passes: int) -> tuple[int, ...]:
    """Commits per pass when ``masks`` positions are spread over ``passes`` passes: ``masks // passes`` each, one
    more for the first ``masks % passes`` (SDAR's and LLaDA's ``num_transfer_tokens``)."""
    if passes < 1:
        raise ValueError(f"a block needs at least one denoising pass, got {passes}")
    base, extra = divmod(masks, passes)
    return tuple(base + (1 if i < extra else 0) for i in range(passes))


def dream_timesteps(steps: int, device: torch.device | None = None) -> torch.Tensor:
    """Dream's float32 ``linspace(1, 1e-3, steps + 1)`` (the commit schedule is computed from it). -> float32 [S+1]"""
    return torch.linspace(1, 1e-3, steps + 1, device=device)


def dream_commits(masks: int, pass_index: int, timesteps: torch.Tensor) -> int:
    """Dream's commit count at a pass: ``int(M * (1 - s / t))`` in float32, everything left at the last pass."""
    steps = timesteps.shape[0] - 1
    if pass_index >= steps:
        return 0  # past the loop's last pass
    mask_count = torch.tensor(masks, device=timesteps.device) / 1  # the authors' float tensor of masks per row
    if pass_index == steps - 1:
        return int(mask_count)
    t, s = timesteps[pass_index], timesteps[pass_index + 1]
    return int(mask_count * (1 - s / t))


# ----------------------------------------------------------------------------------------------- shared numerics


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits (0: all), the rest at the dtype's minimum. [..., V] -> [..., V]"""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p`` (the token that crosses it is
    kept; 1: all), the rest at the dtype's minimum. [..., V] -> [..., V]"""
    if p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, descending=True, dim=-1)
    before = torch.softmax(ordered, dim=-1).cumsum(-1) - torch.softmax(ordered, dim=-1)  # mass above each token
    drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= p)
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)


def sample(scores: torch.Tensor, gumbel: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """The token per row: ``argmax`` of ``scores`` at T = 0 (first index on ties), else the Gumbel-max of
    ``scores / T`` under the keyed noise (float64). scores [M, V], gumbel float64 [M, V] -> int64 [M]"""
    if temperature == 0.0:
        return scores.argmax(-1)
    if gumbel is None:
        raise ValueError("temperature > 0 needs keyed Gumbel noise")
    return (scores.to(torch.float64) / temperature + gumbel.to(scores.device)).argmax(-1)


def _ranked(confidence: torch.Tensor, counts: list[int], window: Window, per_row: bool) -> torch.Tensor:
    """``torch.topk(row, k)`` per state over the authors' row (the block placed at ``window``, -inf elsewhere), in
    the confidences' own dtype; ``per_row``: called on each 1-D row as SDAR and LLaDA do, else on a [1, W] row as
    Dream does (the call decides the tie order). confidence [K, L] (-inf: not eligible), counts K ints -> bool [K, L]
    """
    n_states, length = confidence.shape
    width = max(window.width, window.offset + length)
    chosen = torch.zeros_like(confidence, dtype=torch.bool)
    for state, k in enumerate(counts):
        if k <= 0:
            continue
        row = torch.full((width,), float("-inf"), dtype=confidence.dtype, device=confidence.device)
        row[window.offset : window.offset + length] = confidence[state]
        picked = (torch.topk(row, k).indices if per_row else torch.topk(row[None], k).indices[0]) - window.offset
        picked = picked[(picked >= 0) & (picked < length)]
        chosen[state, picked] = True
    return chosen & (confidence > float("-inf"))


def _result(
    tokens: torch.Tensor,
    where: tuple,
    chosen: torch.Tensor,
    confidence: torch.Tensor,
    committed: torch.Tensor,
    mask_id,
) -> StepResult:
    """Assemble the step's next states from per-masked-position choices (``where``: masked (row, position) pairs,
    ``chosen`` int64 [M], ``confidence`` [M] in any float dtype, ``committed`` bool [K, L]). A committed mask token
    leaves its position masked, as in the authors' loops."""
    proposal_tokens = tokens.clone()
    proposal_tokens[where] = chosen
    full = torch.full(tokens.shape, float("-inf"), dtype=torch.float64, device=tokens.device)
    full[where] = confidence.to(torch.float64)
    return StepResult(
        tokens=torch.where(committed, proposal_tokens, tokens),
        committed=committed,
        proposal=Proposal(tokens=proposal_tokens, confidence=full),
    )


def _rows(gumbel: torch.Tensor | None, where: tuple) -> torch.Tensor | None:
    """The noise rows of the masked positions (None without noise). float64 [K, L, V] -> [M, V]"""
    return None if gumbel is None else gumbel[where]


def _confidence_rows(tokens: torch.Tensor, where: tuple, values: torch.Tensor) -> torch.Tensor:
    """Scatter per-masked-position confidences [M] into [K, L] of their dtype, -inf elsewhere."""
    rows = torch.full(tokens.shape, float("-inf"), dtype=values.dtype, device=tokens.device)
    rows[where] = values
    return rows


# ---------------------------------------------------------------------------------------------------- families


@dataclass(frozen=True)
class SdarRule:
    """SDAR's pass as its HF evaluation wrapper decides it (``huggingface_bd3.py``): the token sampled from the
    tempered, top-k / top-p filtered logits (T = 0: their greedy recipe, T = 1 with top_k = 1, i.e. the argmax);
    confidence = softmax(logits / T) at the token before filtering (T = 1 at greedy), in the logits' dtype; commit
    the ``schedule[s]`` most confident masked positions (``torch.topk`` over the block), or with ``threshold`` < 1
    (``low_confidence_dynamic``) every one above it when there are at least ``schedule[s]``."""

    mask_id: int
    schedule: tuple[int, ...]  # commits per pass inside a block: L // steps, one more for the first L % steps
    temperature: float = 0.0
    threshold: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def passes(self) -> int:
        return len(self.schedule)

    def step(
        self, tokens: torch.Tensor, logits: torch.Tensor, gumbel, steps: tuple[int, ...], window: Window = Window()
    ) -> StepResult:
        """tokens int64 [K, L], logits [K, L, V], gumbel float64 [K, L, V] or None, steps K pass indices."""
        where = (tokens == self.mask_id).nonzero(as_tuple=True)
        z = logits[where]  # [M, V] in the model's dtype
        scale = self.temperature if self.temperature > 0 else 1.0
        scores = top_p_filter(top_k_filter(z / scale, self.top_k), self.top_p)
        chosen = sample(scores, _rows(gumbel, where), 1.0 if self.temperature > 0 else 0.0)  # scores are tempered
        confidence = torch.softmax(z / scale, dim=-1).gather(-1, chosen[:, None])[:, 0]  # [M], model dtype
        conf = _confidence_rows(tokens, where, confidence)  # [K, L]
        counts = _counts(tokens, steps, self.mask_id, lambda masks, s: _scheduled(self.schedule, s))
        committed = _ranked(conf, counts, Window(), per_row=True)
        if self.threshold < 1.0:
            above = conf > self.threshold
            enough = above.sum(-1) >= torch.tensor(counts, device=conf.device)
            committed = torch.where(enough[:, None], above, committed)
        return _result(tokens, where, chosen, confidence, committed, self.mask_id)


@dataclass(frozen=True)
class LladaRule:
    """LLaDA's pass (``generate.py``, ``remasking='low_confidence'``): token = argmax of the logits over the whole
    vocabulary (T > 0: Gumbel-max of logits / T), confidence = softmax(logits) at it in the logits' dtype; commit the
    ``schedule[s]`` most confident masked positions by ``torch.topk`` over the whole canvas row."""

    mask_id: int
    schedule: tuple[int, ...]  # commits per pass inside a block (LLaDA's num_transfer_tokens)
    temperature: float = 0.0

    @property
    def passes(self) -> int:
        return len(self.schedule)

    def step(
        self, tokens: torch.Tensor, logits: torch.Tensor, gumbel, steps: tuple[int, ...], window: Window = Window()
    ) -> StepResult:
        where = (tokens == self.mask_id).nonzero(as_tuple=True)
        z = logits[where]  # [M, V]
        chosen = sample(z, _rows(gumbel, where), self.temperature)
        confidence = torch.softmax(z, dim=-1).gather(-1, chosen[:, None])[:, 0]
        counts = _counts(tokens, steps, self.mask_id, lambda masks, s: _scheduled(self.schedule, s))
        committed = _ranked(_confidence_rows(tokens, where, confidence), counts, window, per_row=True)
        return _result(tokens, where, chosen, confidence, committed, self.mask_id)


@dataclass(frozen=True)
class LladaThresholdRule:
    """Fast-dLLM v1's threshold pass on LLaDA's canvas (``llada/generate.py``, ``generate`` with ``threshold``, no
    cache): token as LLaDA's; confidence = float64 softmax(logits) at it; ``torch.topk`` over the canvas row with k =
    the block's masked positions; commit its first (the most confident) and every later one at or above ``tau``."""

    mask_id: int
    tau: float
    temperature: float = 0.0
    passes = None  # no schedule: every pass commits at least one position

    def step(
        self, tokens: torch.Tensor, logits: torch.Tensor, gumbel, steps: tuple[int, ...], window: Window = Window()
    ) -> StepResult:
        where = (tokens == self.mask_id).nonzero(as_tuple=True)
        z = logits[where]  # [M, V]
        chosen = sample(z, _rows(gumbel, where), self.temperature)
        confidence = torch.softmax(z.to(torch.float64), dim=-1).gather(-1, chosen[:, None])[:, 0]
        conf = _confidence_rows(tokens, where, confidence)  # float64 [K, L]
        counts = (tokens == self.mask_id).sum(-1).tolist()
        order = _topk_order(conf, counts, window)
        committed = torch.zeros_like(tokens, dtype=torch.bool)
        for state, positions in enumerate(order):
            if positions:
                committed[state, positions[0]] = True  # the first of topk always commits
                committed[state, positions[1:]] = conf[state, positions[1:]] >= self.tau
        return _result(tokens, where, chosen, confidence, committed, self.mask_id)


def _topk_order(confidence: torch.Tensor, counts: list[int], window: Window) -> list[list[int]]:
    """Per state, the block positions ``torch.topk(row, k)`` returns in order, over the 1-D canvas row."""
    length = confidence.shape[1]
    width = max(window.width, window.offset + length)
    orders = []
    for state, k in enumerate(counts):
        row = torch.full((width,), float("-inf"), dtype=confidence.dtype, device=confidence.device)
        row[window.offset : window.offset + length] = confidence[state]
        picked = (torch.topk(row, k).indices - window.offset).tolist() if k > 0 else []
        orders.append([p for p in picked if 0 <= p < length])
    return orders


@dataclass(frozen=True)
class DreamRule:
    """Dream's pass (``diffusion_generate``, ``alg`` entropy / maskgit_plus / topk_margin, ``alg_temp`` 0): probs =
    softmax of the tempered, top-p then top-k filtered logits in their dtype; token = ``probs.max(-1)`` (T > 0:
    Gumbel-max of the filtered logits / T); confidence per ``alg``; commit Dream's float32 linspace count of the most
    confident masked positions by ``torch.topk`` over the whole canvas row."""

    mask_id: int
    steps: int  # passes in all (the whole generation is one block)
    temperature: float = 0.0
    confidence: str = "entropy"
    top_k: int = 0
    top_p: float = 1.0

    @property
    def passes(self) -> int:
        return self.steps

    def __post_init__(self) -> None:
        if self.confidence not in DREAM_CONFIDENCES:
            raise ValueError(f"unknown Dream alg {self.confidence!r}; choose one of {', '.join(DREAM_CONFIDENCES)}")

    def step(
        self, tokens: torch.Tensor, logits: torch.Tensor, gumbel, steps: tuple[int, ...], window: Window = Window()
    ) -> StepResult:
        where = (tokens == self.mask_id).nonzero(as_tuple=True)
        z = logits[where]  # [M, V]
        if self.temperature > 0:
            z = z / self.temperature
        z = top_k_filter(top_p_filter(z, self.top_p), self.top_k)
        probs = torch.softmax(z, dim=-1)  # model dtype
        chosen = (
            sample(z, _rows(gumbel, where), 1.0) if self.temperature > 0 else probs.max(-1).indices
        )  # z is tempered
        if self.confidence == "maskgit_plus":
            confidence = probs.gather(-1, chosen[:, None])[:, 0]
        elif self.confidence == "topk_margin":
            top2 = torch.sort(probs, dim=-1, descending=True).values[:, :2]
            confidence = top2[:, 0] - top2[:, 1]
        else:
            confidence = (probs * torch.log(probs + 1e-10)).sum(-1)
        timesteps = dream_timesteps(self.steps, logits.device)
        counts = _counts(tokens, steps, self.mask_id, lambda masks, s: dream_commits(masks, s, timesteps))
        committed = _ranked(_confidence_rows(tokens, where, confidence), counts, window, per_row=False)
        return _result(tokens, where, chosen, confidence, committed, self.mask_id)


@dataclass(frozen=True)
class FastDllmV2Rule:
    """Fast-dLLM v2's pass (``batch_sample``): only the masked positions of the first sub-block that still has masks
    are eligible (sub-blocks decoded left to right); probs = softmax(logits / T) in their dtype (top-p renormalised
    at T > 0); token = argmax of the probs (T > 0: Gumbel-max of the filtered logits / T), confidence = its prob;
    commit every eligible position above ``threshold`` (strict) plus the most confident one (``argmax``)."""

    mask_id: int
    temperature: float = 0.0
    threshold: float = 1.0
    sub_block: int = 8
    top_p: float = 1.0
    passes = None  # no schedule: every pass commits at least one position

    def step(
        self, tokens: torch.Tensor, logits: torch.Tensor, gumbel, steps: tuple[int, ...], window: Window = Window()
    ) -> StepResult:
        masked = tokens == self.mask_id  # [K, L]
        where = masked.nonzero(as_tuple=True)
        z = logits[where]  # [M, V]
        if self.temperature > 0:
            z = top_p_filter(z / self.temperature, self.top_p)
        probs = torch.softmax(z, dim=-1)
        chosen = sample(z, _rows(gumbel, where), 1.0) if self.temperature > 0 else probs.argmax(-1)
        confidence = probs.gather(-1, chosen[:, None])[:, 0]
        conf = _confidence_rows(tokens, where, confidence)  # [K, L]
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        first = torch.where(masked, positions, tokens.shape[1]).min(-1).values  # [K]: first masked position
        start = (first // self.sub_block) * self.sub_block
        current = (positions >= start[:, None]) & (positions < start[:, None] + self.sub_block)
        conf = conf.masked_fill(~current, float("-inf"))
        best = torch.zeros_like(masked)
        best.scatter_(1, conf.argmax(-1, keepdim=True), True)
        committed = ((conf > self.threshold) | best) & masked & current
        return _result(tokens, where, chosen, confidence, committed, self.mask_id)


def _scheduled(schedule: tuple[int, ...], pass_index: int) -> int:
    """Commits at a pass of the schedule (none past its end)."""
    return schedule[pass_index] if pass_index < len(schedule) else 0


def _counts(tokens: torch.Tensor, steps: tuple[int, ...], mask_id: int, count) -> list[int]:
    """Commits per state from ``count(masks, pass_index)``; a complete state commits nothing (and has no pass)."""
    masks = (tokens == mask_id).sum(-1).tolist()
    return [count(m, s) if m else 0 for m, s in zip(masks, steps)]


@dataclass(frozen=True)
class FamilyDecoding:
    """What a family's rule depends on, as the user sets it (``None``: the authors' default)."""

    family: str
    kind: str  # the project's rule kind the method asks for: one (standard), threshold, dynamic
    mask_id: int
    temperature: float
    block_length: int
    gen_length: int
    tau: float = 0.9
    steps: int | None = None  # SDAR: passes per block (default L); LLaDA, Dream: passes in all (default G)
    confidence: str | None = None  # Dream's alg (default entropy)
    top_k: int = 0
    top_p: float = 1.0


def make_family_rule(spec: FamilyDecoding):
    """The family's own rule for a method's rule kind; a clear error for kinds its authors do not ship."""
    name, kind = spec.family, spec.kind
    shipped = {
        "sdar": ("one", "dynamic"),
        "llada": ("one", "threshold"),
        "dream": ("one",),
        "fast_dllm_v2": ("one", "threshold"),
    }
    if kind not in shipped[name]:
        methods = {"one": "standard (and its speculative methods)", "dynamic": "dynamic", "threshold": "threshold"}
        allowed = ", ".join(methods[k] for k in shipped[name])
        raise ValueError(f"the {name} authors ship no {kind} rule; this family decodes with: {allowed}")
    length, temperature = spec.block_length, spec.temperature
    if name == "sdar":
        steps = spec.steps or length
        if length % steps:
            raise ValueError(f"SDAR's evaluation loop needs the block length ({length}) to be a multiple of steps")
        threshold = spec.tau if kind == "dynamic" else 1.0
        schedule = linear_schedule(length, steps)
        return SdarRule(spec.mask_id, schedule, temperature, threshold, spec.top_k, spec.top_p)
    if name == "llada" and kind == "threshold":
        return LladaThresholdRule(spec.mask_id, spec.tau, temperature)
    if name == "llada":
        n_blocks = spec.gen_length // length
        steps = spec.steps or spec.gen_length
        if steps % n_blocks:
            raise ValueError(f"LLaDA's loop needs steps ({steps}) to be a multiple of the blocks ({n_blocks})")
        return LladaRule(spec.mask_id, linear_schedule(length, steps // n_blocks), temperature)
    if name == "dream":
        return DreamRule(
            spec.mask_id,
            spec.steps or spec.gen_length,
            temperature,
            spec.confidence or "entropy",
            spec.top_k,
            spec.top_p,
        )
    threshold = spec.tau if kind == "threshold" else 1.0
    return FastDllmV2Rule(spec.mask_id, temperature, threshold, top_p=spec.top_p)
