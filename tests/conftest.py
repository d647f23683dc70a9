"""Shared fixtures: a tiny random float64 target, a small trained tokenizer and a checkpoint folder built from them;
for the drafter tests a saved order model and collected trajectory shards."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spot_dlm.drafters.folder import save_order_model
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.models.checkpoint import TOKENIZER_FILE, save_checkpoint
from spot_dlm.models.tokenizer import TextCodec, train_tokenizer
from spot_dlm.models.transformer import BlockDiffusionLM, ModelConfig
from spot_dlm.train.collect import CollectConfig
from trajectories import neighbour_fit_folder, run_collect

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _budget_cache(tmp_path_factory):
    """budget auto reads measurements from the user cache folder: tests see an empty one of their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPOT_DLM_CACHE", str(tmp_path_factory.mktemp("spot_dlm_cache")))
        yield


TINY_VOCAB = 40


def random_model(
    vocab_size: int = TINY_VOCAB, seed: int = 0, dtype: torch.dtype = torch.float64, max_seq_len: int = 256
) -> BlockDiffusionLM:
    """A tiny seeded BlockDiffusionLM in eval mode.

    The default initialisation (std 0.02) gives almost uniform logits and attention; the weights are redrawn with
    a larger spread so that the context matters and the logits are peaked enough for decisions to differ.
    """
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2, max_seq_len=max_seq_len)
    model = BlockDiffusionLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model.to(dtype).eval()


@pytest.fixture(scope="session")
def tiny_model() -> BlockDiffusionLM:
    return random_model()


@pytest.fixture(scope="session")
def model_factory() -> Callable[..., BlockDiffusionLM]:
    """``random_model`` for tests that need other seeds, vocabularies or dtypes."""
    return random_model


@pytest.fixture
def make_target(tiny_model: BlockDiffusionLM) -> Callable[..., BuiltinTarget]:
    """Factory for a BuiltinTarget on the tiny model (fresh pass counter each call)."""

    def build(scoring: str = "batched", use_cache: bool = True) -> BuiltinTarget:
        return BuiltinTarget(model=tiny_model, scoring=scoring, use_cache=use_cache)

    return build


TOKENIZER_TEXTS = [
    f"Question: what is {a} + {b}?\nAnswer: {a} + {b} = {a + b}. The {word} sat on mat number {a * b}."
    for a in range(8)
    for b in range(5)
    for word in ("cat", "dog")
][:60]


@pytest.fixture(scope="session")
def tiny_codec() -> TextCodec:
    return TextCodec(train_tokenizer(TOKENIZER_TEXTS, vocab_size=300))


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory, tiny_codec: TextCodec) -> Path:
    """A checkpoint folder (weights, config, tokenizer) of a random model whose vocabulary matches tiny_codec."""
    folder = tmp_path_factory.mktemp("checkpoint") / "tiny-ckpt"
    model = random_model(vocab_size=tiny_codec.vocab_size, seed=1, dtype=torch.float32, max_seq_len=128)
    save_checkpoint(model, folder)
    tiny_codec.save(folder / TOKENIZER_FILE)
    return folder


@pytest.fixture(scope="session")
def long_checkpoint(tmp_path_factory, tiny_codec) -> Path:
    """A random checkpoint whose context fits GSM8K training prompts under the tiny tokenizer."""

    folder = tmp_path_factory.mktemp("long") / "ckpt"
    save_checkpoint(random_model(tiny_codec.vocab_size, seed=5, dtype=torch.float32, max_seq_len=1024), folder)
    tiny_codec.save(folder / TOKENIZER_FILE)
    return folder


@pytest.fixture(scope="module")
def remote_code_cache(tmp_path_factory):
    """Keep transformers' copies of the remote code in a temporary folder, not under the user's HF home."""
    import transformers.dynamic_module_utils as dynamic

    def forget_remote_modules():
        for name in [name for name in sys.modules if name.startswith("transformers_modules")]:
            del sys.modules[name]

    cache = tmp_path_factory.mktemp("hf_modules")
    forget_remote_modules()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dynamic, "HF_MODULES_CACHE", str(cache))
        patch.syspath_prepend(str(cache))
        yield
    forget_remote_modules()


# ------------------------------------------------------------------ drafters: a saved order model, collected shards
# (collected once per session: the collect and train tests read the same shards)


@pytest.fixture
def saved_order_model(tmp_path: Path) -> tuple[OrderModel, Path]:
    """A random order model of a small shape and the drafter folder it was saved to (with metrics)."""
    torch.manual_seed(1)
    config = OrderModelConfig(d_model=32, n_layers=2, n_heads=4, max_block_length=16)
    model = OrderModel(config).eval()
    folder = tmp_path / "drafter"
    save_order_model(model, folder, metrics={"note": "random"})
    return model, folder


@pytest.fixture(scope="session")
def collect_target(tiny_codec, model_factory) -> BuiltinTarget:
    """A tiny random target whose vocabulary matches the conftest tokenizer, with room for GSM8K prompts."""
    model = model_factory(vocab_size=tiny_codec.vocab_size, seed=3, dtype=torch.float32, max_seq_len=512)
    return BuiltinTarget(model)


@pytest.fixture(scope="session")
def standard_shards(tmp_path_factory, collect_target, tiny_codec) -> tuple[CollectConfig, list[Path]]:
    return run_collect(collect_target, tiny_codec, tmp_path_factory.mktemp("traj") / "standard")


@pytest.fixture(scope="session")
def threshold_shards(tmp_path_factory, collect_target, tiny_codec) -> tuple[CollectConfig, list[Path]]:
    out = tmp_path_factory.mktemp("traj") / "threshold"
    return run_collect(collect_target, tiny_codec, out, method="threshold", taus=(0.1,))


@pytest.fixture(scope="session")
def corrected_shards(tmp_path_factory, collect_target, tiny_codec) -> tuple[CollectConfig, list[Path]]:
    base = tmp_path_factory.mktemp("traj")
    folder = neighbour_fit_folder(collect_target.vocab_size, base / "fit")
    return run_collect(collect_target, tiny_codec, base / "corrected", neighbours=str(folder))
