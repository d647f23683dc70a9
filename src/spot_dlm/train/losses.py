"""Training losses of the built-in target: autoregressive pretraining and block-diffusion fine-tuning."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spot_dlm.models.layout import attention_mask, clean_layout, two_stream_layout
from spot_dlm.models.transformer import BlockDiffusionLM


@dataclass(frozen=True)
class LossOutput:
    loss: torch.Tensor  # scalar, mean cross-entropy over predicted tokens
    n_tokens: int  # how many tokens were predicted


def autoregressive_loss(model: BlockDiffusionLM, tokens: torch.Tensor) -> LossOutput:
    """Next-token cross-entropy with clean causal attention. tokens int64 [B, T]"""
    batch, seq_len = tokens.shape
    layout = clean_layout(0, seq_len, tokens.device)
    mask = attention_mask(layout, 0)[None].expand(batch, -1, -1)
    hidden, _ = model(tokens, layout.positions[None].expand(batch, -1), mask)  # [B, T, d]
    logits = model.logits(hidden[:, :-1])  # [B, T-1, V]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    return LossOutput(loss=loss, n_tokens=batch * (seq_len - 1))


def mask_blocks(
    tokens: torch.Tensor, block_length: int, mask_id: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask each block with its own ratio t ~ U(0, 1).

    tokens [B, T] -> (noisy [B, T], is_masked bool [B, T], ratio float [B, T]: the t of each token's block)
    """
    batch, seq_len = tokens.shape
    ratio = torch.rand(batch, seq_len // block_length, 1, generator=generator, device=tokens.device)
    ratio = ratio.expand(-1, -1, block_length).reshape(batch, seq_len)
    is_masked = torch.rand(batch, seq_len, generator=generator, device=tokens.device) < ratio
    return torch.where(is_masked, torch.full_like(tokens, mask_id), tokens), is_masked, ratio


def block_diffusion_loss(
    model: BlockDiffusionLM,
    tokens: torch.Tensor,
    block_length: int,
    generator: torch.Generator,
    nelbo: bool = False,
    teacher: BlockDiffusionLM | None = None,
) -> LossOutput:
    """Masked cross-entropy inside blocks, clean earlier text as context (two-stream input [clean ; noisy]).

    The token at position p is predicted from the hidden state at p - 1: inside a block that is the noisy
    stream, at a block's first position it is the clean stream (the last token before the block).
    tokens int64 [B, T] with T a multiple of block_length. ``nelbo=True`` returns the negative ELBO per token
    instead (each masked token's cross-entropy weighted by 1 / t of its block, averaged over all predicted
    positions), the masked-diffusion likelihood bound. With a ``teacher`` (a trained model over the same vocabulary)
    the target of each masked position is the teacher's distribution on the same noisy input instead of the clean
    token (distillation: soft cross-entropy, i.e. KL to the teacher plus its entropy).
    """
    if teacher is not None and nelbo:
        raise ValueError("distillation trains on the teacher's distributions, not the masked-diffusion bound")
    batch, seq_len = tokens.shape
    noisy, is_masked, ratio = mask_blocks(tokens, block_length, model.config.mask_id, generator)
    inputs = torch.cat([tokens, noisy], 1)  # [B, 2T]: the two-stream input
    layout = two_stream_layout(seq_len, block_length, tokens.device)
    mask = attention_mask(layout, 0)[None].expand(batch, -1, -1)
    positions = layout.positions[None].expand(batch, -1)
    targets = is_masked[:, 1:]
    logits = masked_logits(model, inputs, positions, mask, targets, block_length)  # [M, V]
    n_tokens = int(targets.sum())
    if teacher is not None:
        if n_tokens == 0:
            return LossOutput(loss=logits.sum() * 0.0, n_tokens=0)
        with torch.no_grad():
            taught = masked_logits(teacher, inputs, positions, mask, targets, block_length).float()  # [M, V]
        soft = -(torch.softmax(taught, -1) * torch.log_softmax(logits.float(), -1)).sum(-1)  # [M]
        return LossOutput(loss=soft.mean(), n_tokens=n_tokens)
    if nelbo:
        per_token = F.cross_entropy(logits.float(), tokens[:, 1:][targets], reduction="none")
        weighted = (per_token / ratio[:, 1:][targets].clamp_min(1e-3)).sum()
        return LossOutput(loss=weighted / targets.numel(), n_tokens=targets.numel())
    if n_tokens == 0:
        return LossOutput(loss=logits.sum() * 0.0, n_tokens=0)
    loss = F.cross_entropy(logits.float(), tokens[:, 1:][targets])
    return LossOutput(loss=loss, n_tokens=n_tokens)


def masked_logits(
    model: BlockDiffusionLM,
    inputs: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    targets: torch.Tensor,
    block_length: int,
) -> torch.Tensor:
    """Logits predicting the masked positions of a two-stream batch (``block_diffusion_loss``'s layout).

    inputs int64 [B, 2T] (clean ; noisy), positions [B, 2T], mask [B, 2T, 2T], targets bool [B, T - 1] (which of
    positions 1..T-1 are masked) -> [M, V], M = targets.sum(), in row-major order of ``targets``"""
    seq_len = inputs.shape[1] // 2
    hidden, _ = model(inputs, positions, mask)  # [B, 2T, d]
    clean_hidden, noisy_hidden = hidden[:, :seq_len], hidden[:, seq_len:]
    starts_block = (torch.arange(1, seq_len, device=inputs.device) % block_length == 0)[None, :, None]
    predictor = torch.where(starts_block, clean_hidden[:, :-1], noisy_hidden[:, :-1])  # predicts positions 1..T-1
    return model.logits(predictor[targets])
