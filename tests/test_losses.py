"""Block-diffusion training losses: distillation from a teacher is the soft cross-entropy to its distributions."""

from __future__ import annotations

import pytest
import torch

from spot_dlm.models.layout import attention_mask, two_stream_layout
from spot_dlm.train.losses import block_diffusion_loss, mask_blocks, masked_logits

BLOCK = 8


def batch(seed: int, vocab: int = 40, rows: int = 3, length: int = 32) -> torch.Tensor:
    return torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def distil(student, teacher, tokens: torch.Tensor, seed: int) -> torch.Tensor:
    return block_diffusion_loss(student, tokens, BLOCK, torch.Generator().manual_seed(seed), teacher=teacher).loss


@pytest.mark.parametrize("seed", range(4))
def test_distillation_is_the_soft_cross_entropy_to_the_teachers_distributions(model_factory, seed: int) -> None:
    student, teacher = model_factory(seed=seed), model_factory(seed=seed + 10)
    tokens = batch(seed)
    noisy, is_masked, _ = mask_blocks(tokens, BLOCK, student.config.mask_id, torch.Generator().manual_seed(seed))
    layout = two_stream_layout(tokens.shape[1], BLOCK, tokens.device)
    mask = attention_mask(layout, 0)[None].expand(tokens.shape[0], -1, -1)
    positions = layout.positions[None].expand(tokens.shape[0], -1)
    inputs, targets = torch.cat([tokens, noisy], 1), is_masked[:, 1:]
    p = torch.softmax(masked_logits(teacher, inputs, positions, mask, targets, BLOCK), -1)  # [M, V]
    log_q = torch.log_softmax(masked_logits(student, inputs, positions, mask, targets, BLOCK), -1)
    expected = -(p * log_q).sum(-1).mean()
    assert torch.allclose(distil(student, teacher, tokens, seed), expected.float(), rtol=1e-5)  # float32 loss
    # Gibbs: the teacher itself has the lowest soft cross-entropy (its entropy); another model pays the KL on top
    assert distil(teacher, teacher, tokens, seed) < distil(student, teacher, tokens, seed)


def test_distillation_moves_the_student_towards_the_teacher(model_factory) -> None:
    student, teacher = model_factory(seed=1).train(), model_factory(seed=2)
    tokens = batch(7)
    before = float(distil(student, teacher, tokens, 0).detach())
    optimizer = torch.optim.SGD(student.parameters(), lr=0.05)
    for step in range(20):
        optimizer.zero_grad()
        distil(student, teacher, tokens, step).backward()
        optimizer.step()
    assert float(distil(student, teacher, tokens, 0).detach()) < before
    assert all(p.grad is None for p in teacher.parameters())  # the teacher is read, never trained


def test_distillation_has_no_likelihood_bound(tiny_model) -> None:
    model = tiny_model
    with pytest.raises(ValueError, match="bound"):
        block_diffusion_loss(model, batch(0), BLOCK, torch.Generator().manual_seed(0), nelbo=True, teacher=model)
