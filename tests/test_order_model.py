"""The order model network and its inputs (``drafters/order_net.py``, ``drafters/order_features.py``): size,
equality with torch's encoder, the frozen trace, one host thread, the feature layout and stale top-k
probabilities."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_contexts import MASK
from spot_dlm.drafters.guesses import stale_log_normaliser
from spot_dlm.drafters.order_features import largest_values, order_features, stale_top_probs
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig, freeze_order_model, one_host_thread

torch.set_num_threads(1)


def test_order_model_size_and_shape() -> None:
    torch.manual_seed(0)
    model = OrderModel(OrderModelConfig()).eval()
    n_params = sum(p.numel() for p in model.parameters())
    assert 500_000 <= n_params <= 700_000
    features = torch.rand(3, 16, OrderModelConfig().n_features)
    assert model(features).shape == (3, 16)
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.rand(1, 65, OrderModelConfig().n_features))


def test_order_model_equals_torch_transformer_encoder() -> None:
    """The written-out layers compute what nn.TransformerEncoder (pre-norm, GELU) computes with the same weights,
    so checkpoints trained with either load into the other."""
    torch.manual_seed(3)
    config = OrderModelConfig(top_k=8, d_model=32, n_layers=2, n_heads=4)
    model = OrderModel(config).eval()
    layer = torch.nn.TransformerEncoderLayer(
        32, 4, 128, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    reference = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.3)
    model.encoder.load_state_dict(reference.state_dict())
    x = torch.randn(3, 16, 32)
    with torch.inference_mode():
        assert torch.allclose(model.encoder(x), reference(x), atol=1e-5)
    reference.train()  # the slow (non-fused) path too
    with torch.no_grad():
        assert torch.allclose(model.encoder(x), reference(x), atol=1e-5)


def test_order_model_block_longer_than_max(saved_order_model: tuple[OrderModel, Path]) -> None:
    model, _ = saved_order_model
    with pytest.raises(ValueError, match="block length 17"):
        model(torch.rand(1, 17, model.config.n_features))


@pytest.mark.parametrize("shape", [(1, 16), (3, 16), (7, 5), (15, 1)])
def test_frozen_order_model_gives_the_same_logits_bit_for_bit(
    saved_order_model: tuple[OrderModel, Path], shape: tuple[int, int]
) -> None:
    """One trace (made at a 2-position block) serves every batch size and block length up to the maximum."""
    model, _ = saved_order_model
    frozen = freeze_order_model(model)
    assert frozen.config == model.config and frozen.device == model.device
    features = torch.rand(*shape, model.config.n_features)
    with torch.no_grad():
        assert torch.equal(frozen(features), model(features))
    with pytest.raises(ValueError, match="block length 17"):
        frozen(torch.rand(1, 17, model.config.n_features))


def test_one_host_thread_runs_on_one_thread_and_restores_the_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_host_thread(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), one_host_thread(torch.device("cpu")):
            raise RuntimeError("restored on the way out")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_freezing_leaves_the_trainable_model_alone(saved_order_model: tuple[OrderModel, Path]) -> None:
    model, _ = saved_order_model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    freeze_order_model(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.requires_grad for p in model.parameters())


def test_order_features_layout() -> None:
    top = torch.rand(4, 32)
    stale_masked = torch.tensor([True, True, True, False])
    branch = torch.tensor([False, True, False, False])
    coupled = torch.tensor([0.5, 0.25, 0.75, 0.9], dtype=torch.float64)
    features = order_features(top, stale_masked, branch, coupled)
    assert features.shape == (4, 35)
    assert features.dtype == torch.float32
    assert torch.equal(features[:, :32], top)
    assert features[:, 32].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert features[:, 33].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert features[:, 34].tolist() == [0.5, 0.0, 0.75, 0.0]  # coupled confidence only where still open
    config = OrderModelConfig(threshold_feature=True, temperature_feature=True)
    with_rule = order_features(top, stale_masked, branch, coupled, config.extra_inputs(tau=0.8, temperature=1.5))
    assert with_rule.shape == (4, config.n_features) == (4, 37)
    assert torch.equal(with_rule[:, :35], features)
    assert with_rule[:, 35].tolist() == [0.800000011920929] * 4 and with_rule[:, 36].tolist() == [1.5] * 4
    names = config.feature_names  # the names warm starts map columns by
    assert (names[0], names[31], names[34], names.index("tau"), names.index("temperature")) == (
        "top1",
        "top32",
        "coupled_confidence",
        35,
        36,
    )
    assert OrderModelConfig(temperature_feature=True).extra_inputs(tau=0.8, temperature=0.0) == [0.0]


def test_stale_top_probs_excludes_mask_and_sorts() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[:, MASK] = 50.0  # the mask token would dominate if it were not excluded
    top = stale_top_probs(logits, MASK, top_k=8)
    assert top.shape == (5, 8)
    expected = torch.softmax(torch.cat([logits[:, :MASK], logits[:, MASK + 1 :]], -1), -1).topk(8).values
    assert torch.allclose(top, expected.float(), atol=1e-6)
    assert bool((top[:, :-1] >= top[:, 1:]).all())
    known = stale_top_probs(logits, MASK, top_k=8, log_normaliser=stale_log_normaliser(logits, MASK))
    assert torch.allclose(known, top, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_largest_values_are_topk_values(dtype: torch.dtype) -> None:
    """The host partition gives ``topk``'s values, largest first, ties and -inf included, for every k (dtypes numpy
    lacks take ``topk`` itself)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (3, 7, 12), generator=generator).to(dtype)  # many ties
    x[0, 0, :5] = float("-inf")
    for k in (1, 5, 12):
        top = largest_values(x, k)
        assert top.dtype == dtype and top.is_contiguous()
        assert torch.equal(top, x.topk(k, dim=-1).values)
