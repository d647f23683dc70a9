"""Tokenizer and training-data tests (fast: a small tokenizer trained on a few hundred GSM8K texts)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spot_dlm.models.tokenizer import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, TextCodec, format_prompt, train_tokenizer
from spot_dlm.train import data
from spot_dlm.train.data import (
    HELDOUT_SYMBOLIC_SEED,
    TRAIN_SYMBOLIC_SEED,
    build_token_stream,
    clean_gsm8k_answer,
    final_answer,
    gsm_symbolic_items,
    heldout_items,
    load_gsm8k,
    pack_batches,
    tokenizer_sample,
    training_text,
)


def gsm8k_or_skip(split: str) -> list[dict]:
    """GSM8K items, or skip the test where the data folder is absent."""
    try:
        return load_gsm8k(split)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def gsm8k_train() -> list[dict]:
    return gsm8k_or_skip("train")


@pytest.fixture(scope="module")
def codec(gsm8k_train: list[dict]) -> TextCodec:
    return TextCodec(train_tokenizer([training_text(item) for item in gsm8k_train[:300]], vocab_size=512))


def test_calculator_notes_removed() -> None:
    assert clean_gsm8k_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.") == "Natalia sold 48/2 = 24 clips."
    assert clean_gsm8k_answer("$<<12/60=0.2>>0.2 and $<<0.2*50=10>>10") == "$0.2 and $10"
    assert clean_gsm8k_answer("no notes 3 < 4 > 2") == "no notes 3 < 4 > 2"


def test_final_answer() -> None:
    assert final_answer("so 5 + 5 = 10\n#### 10") == "10"
    assert final_answer("#### 1,080") == "1080"
    with pytest.raises(ValueError, match="####"):
        final_answer("no answer")


def test_gsm8k_items(gsm8k_train: list[dict]) -> None:
    assert len(gsm8k_train) == 7473
    first = gsm8k_train[0]
    assert set(first) == {"question", "solution", "answer"}
    assert first["answer"] == "72"
    assert "<<" not in first["solution"] and first["solution"].endswith("#### 72")


def test_special_ids(codec: TextCodec) -> None:
    assert (codec.pad_id, codec.eos_id, codec.mask_id) == (0, 1, 2)
    assert [codec.tokenizer.token_to_id(t) for t in (PAD_TOKEN, EOS_TOKEN, MASK_TOKEN)] == [0, 1, 2]
    assert codec.vocab_size == 512


def test_round_trip(codec: TextCodec, gsm8k_train: list[dict]) -> None:
    test_items = gsm8k_or_skip("test")
    texts = [training_text(item) for item in gsm8k_train[-50:] + test_items[:50]]
    texts += ["Costs £5.50, 20% off: $4.40\nsecond line\n\n  indented", "€3 × 4 ÷ 2 – ½ “quoted”\tTab"]
    for text in texts:
        assert codec.decode(codec.encode(text)) == text


def test_special_strings_in_text_are_plain(codec: TextCodec) -> None:
    ids = codec.encode("a <eos> b <mask> <pad>")
    assert not set(ids) & {0, 1, 2}
    assert codec.decode(ids) == "a <eos> b <mask> <pad>"
    assert codec.decode([codec.eos_id, *codec.encode("hi"), codec.mask_id, codec.pad_id]) == "hi"


def test_digits_are_single_tokens(codec: TextCodec) -> None:
    ids = codec.encode("12345")
    assert [codec.decode([i]) for i in ids] == list("12345")
    pieces = [codec.decode([i]) for i in codec.encode("x 54321, 5.5")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("5432155")


def test_encode_prompt(codec: TextCodec) -> None:
    assert format_prompt("Why?") == "Question: Why?\nAnswer:"
    assert codec.decode(codec.encode_prompt("What is 2+2?")) == "Question: What is 2+2?\nAnswer:"


def test_save_and_load(codec: TextCodec, tmp_path) -> None:
    path = tmp_path / "sub" / "tokenizer.json"
    codec.save(path)
    loaded = TextCodec.from_file(path)
    text = "Question: 12 eggs cost $3.\nAnswer: 4"
    assert loaded.encode(text) == codec.encode(text)


def test_corrupt_tokenizer_file(tmp_path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match="tokenizer.json"):
        TextCodec.from_file(path)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        TextCodec.from_file(tmp_path / "missing.json")


def test_wrong_special_ids_rejected(tmp_path) -> None:
    tokenizer = train_tokenizer(["some text 123"], vocab_size=300)
    bad = tokenizer.to_str().replace('"<pad>"', '"<padx>"')
    path = tmp_path / "bad.json"
    path.write_text(bad)
    with pytest.raises(ValueError, match="<pad>"):
        TextCodec.from_file(path)


def test_build_token_stream(codec: TextCodec, gsm8k_train: list[dict]) -> None:
    items = gsm8k_train[:3]
    stream = build_token_stream(items, codec)
    assert stream.dtype == np.uint16
    assert (stream == codec.eos_id).sum() == 3 and stream[-1] == codec.eos_id
    first = stream[: int(np.argmax(stream == codec.eos_id))]
    assert codec.decode(first) == training_text(items[0])
    assert training_text(items[0]).startswith("Question: ") and "\nAnswer: " in training_text(items[0])


def test_pack_batches() -> None:
    stream = np.arange(1000, dtype=np.uint16)
    batches = pack_batches(stream, seq_len=64, batch_size=8, rng=np.random.default_rng(0))
    for _ in range(5):
        batch = next(batches)
        assert batch.shape == (8, 64) and batch.dtype == np.int64
        assert np.all(np.diff(batch, axis=1) == 1)  # contiguous windows
        assert batch.min() >= 0 and batch.max() < 1000
    with pytest.raises(ValueError):
        next(pack_batches(stream[:10], seq_len=64, batch_size=2, rng=np.random.default_rng(0)))


def test_symbolic_splits_do_not_overlap() -> None:
    pytest.importorskip("reasoning_gym")
    train = gsm_symbolic_items(TRAIN_SYMBOLIC_SEED, 200)
    heldout = heldout_items("gsm_symbolic", 200)
    assert heldout == gsm_symbolic_items(HELDOUT_SYMBOLIC_SEED, 200)
    assert not {item["question"] for item in train} & {item["question"] for item in heldout}
    assert all(item["solution"].rstrip().rsplit("####", 1)[1].strip() for item in train)


def test_heldout_exclusion() -> None:
    pytest.importorskip("reasoning_gym")
    first = heldout_items("gsm_symbolic", 20)
    excluded = {first[0]["question"], first[5]["question"]}
    kept = heldout_items("gsm_symbolic", 20, excluded)
    assert len(kept) == 20 and not excluded & {item["question"] for item in kept}
    assert kept[:18] == [item for i, item in enumerate(first) if i not in (0, 5)]


def test_tokenizer_sample() -> None:
    texts = [f"t{i}" for i in range(100)]
    sample = tokenizer_sample(texts, n_keep=10, size=30)
    assert len(sample) == 30 and sample[:10] == texts[:10] and len(set(sample)) == 30
    assert tokenizer_sample(texts, n_keep=10, size=500) == texts


def test_heldout_unknown_source() -> None:
    with pytest.raises(ValueError, match="gsm8k, gsm_symbolic"):
        heldout_items("mmlu", 10)


def test_gsm8k_root_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(data.GSM8K_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=data.GSM8K_ENV):
        load_gsm8k("train")
    (tmp_path / "test.jsonl").write_text('{"question": "Q?", "answer": "1+1=<<1+1=2>>2\\n#### 2"}\n')
    assert load_gsm8k("test") == [{"question": "Q?", "answer": "2", "solution": "1+1=2\n#### 2"}]


def test_prepare_corpus_small(gsm8k_train: list[dict], tmp_path, monkeypatch) -> None:
    pytest.importorskip("reasoning_gym")
    monkeypatch.setattr(data, "load_gsm8k", lambda split: gsm8k_train[:30] if split == "train" else gsm8k_train[30:60])
    monkeypatch.setattr(data, "HELDOUT_PER_SOURCE", 10)
    out = data.prepare_corpus(tmp_path / "corpus", n_symbolic=50, vocab_size=300)
    meta = json.loads((out / "corpus.json").read_text())
    train = np.load(out / "train_tokens.npy")
    heldout = np.load(out / "heldout_tokens.npy")
    assert meta["train"] == {"gsm8k_items": 30, "gsm_symbolic_items": 50, "tokens": len(train)}
    assert (train == 1).sum() == 80 and (heldout == 1).sum() == 20 and train.dtype == np.uint16
    assert meta["heldout"]["token_ranges"]["gsm_symbolic"][1] == len(heldout)
    mtime = (out / "train_tokens.npy").stat().st_mtime_ns
    assert data.prepare_corpus(out, n_symbolic=50, vocab_size=300) == out
    assert (out / "train_tokens.npy").stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="built with"):
        data.prepare_corpus(out, n_symbolic=60, vocab_size=300)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", False),
        ("The total is 1000000000000000000000000000000 = 20", True),
        ("a\na\na\na\na\na", True),
        ("yes yes no yes no yes no yes no yes no yes", True),
        ("2 * 100000 = 200000\n#### 200000", False),
    ],
)
def test_is_degenerate(text: str, expected: bool) -> None:
    from spot_dlm.train.evaluate import is_degenerate

    assert is_degenerate(text) is expected
