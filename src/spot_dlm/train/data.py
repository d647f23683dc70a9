"""Training and held-out data: GSM8K worked solutions plus procedurally generated `gsm_symbolic` problems.

Splits (an item is a dict with keys `question`, `solution`, `answer`):

- TRAIN: GSM8K `train.jsonl` (calculator notes `<<...>>` removed) and `gsm_symbolic` items from reasoning-gym
  with seed `TRAIN_SYMBOLIC_SEED` (any size below `HELDOUT_SYMBOLIC_SEED`).
- HELD OUT: GSM8K `test.jsonl` and `gsm_symbolic` items with seed `HELDOUT_SYMBOLIC_SEED`.

reasoning-gym seeds item `i` of a dataset with seed `s` by `Random(s + i)`, so the two symbolic seeds draw disjoint
random streams while the training set has fewer than 10M items. Still, both symbolic splits share the same 85
templates (only names and numbers differ), so some held-out questions repeat training ones verbatim (52 of the
first 500 against 100k training items); `prepare_corpus` holds out only unseen ones. The templates were written
from GSM8K *test* questions, so GSM8K test is not fully independent of symbolic training data either.

The GSM8K directory is `$SPOT_DLM_GSM8K`, else the first existing `GSM8K_DEFAULT_ROOTS` entry.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from spot_dlm.models.tokenizer import TextCodec, format_prompt, train_tokenizer
from spot_dlm.safety import write_atomic, write_text_atomic

GSM8K_ENV = "SPOT_DLM_GSM8K"
GSM8K_DEFAULT_ROOTS = (
    Path(__file__).resolve().parents[1] / "assets" / "gsm8k",  # shipped copy (MIT, see LICENSE there)
    Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "gsm8k",
)
TRAIN_SYMBOLIC_SEED = 0
HELDOUT_SYMBOLIC_SEED = 10_000_000
HELDOUT_SOURCES = ("gsm8k", "gsm_symbolic")

TOKENIZER_SAMPLE = 30_000  # texts used to train the tokenizer
HELDOUT_PER_SOURCE = 500  # held-out items per source in heldout_tokens.npy

_CALCULATOR_NOTE = re.compile(r"<<[^>]*>>")


def clean_gsm8k_answer(answer: str) -> str:
    """Remove GSM8K calculator notes: "48/2 = <<48/2=24>>24" -> "48/2 = 24"."""
    return _CALCULATOR_NOTE.sub("", answer)


def final_answer(solution: str) -> str:
    """The number after the last "####", without thousands separators ("1,080" -> "1080")."""
    if "####" not in solution:
        raise ValueError(f"solution has no '####' final answer: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_root() -> Path:
    """The GSM8K data directory (see the module docstring)."""
    if GSM8K_ENV in os.environ:
        return Path(os.environ[GSM8K_ENV])
    for root in GSM8K_DEFAULT_ROOTS:
        if root.is_dir():
            return root
    tried = ", ".join(str(root) for root in GSM8K_DEFAULT_ROOTS)
    raise FileNotFoundError(f"GSM8K data not found in {tried}; set {GSM8K_ENV} to the folder holding train.jsonl")


def gsm8k_item(record: dict) -> dict:
    """One GSM8K jsonl record as an item."""
    solution = clean_gsm8k_answer(record["answer"])
    return {"question": record["question"], "solution": solution, "answer": final_answer(solution)}


def load_gsm8k(split: str, root: Path | None = None) -> list[dict]:
    """GSM8K items of `split` ("train" or "test") from `{root}/{split}.jsonl`."""
    path = Path(root if root is not None else gsm8k_root()) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"GSM8K file not found: {path} (set {GSM8K_ENV} to the folder holding it)")
    with path.open(encoding="utf-8") as f:
        return [gsm8k_item(json.loads(line)) for line in f if line.strip()]


def gsm_symbolic_items(seed: int, size: int) -> list[dict]:
    """`size` reasoning-gym `gsm_symbolic` items of `seed`; questions keep the trailing answer instruction."""
    import reasoning_gym  # optional dependency (the `train` extra)

    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    items = (dataset[i] for i in range(size))
    return [
        {"question": item["question"], "solution": item["metadata"]["answer_cot"], "answer": str(item["answer"])}
        for item in tqdm(items, total=size, desc=f"gsm_symbolic seed {seed}")
    ]


def unseen(items: list[dict], exclude_questions: Collection[str]) -> list[dict]:
    """The items whose question is not in `exclude_questions`."""
    return [item for item in items if item["question"] not in exclude_questions]


def heldout_items(source: str, n: int, exclude_questions: Collection[str] = frozenset()) -> list[dict]:
    """The first `n` held-out items of `source` whose question is not in `exclude_questions`.

    "gsm8k" is GSM8K test; "gsm_symbolic" is the held-out seed, which repeats about 10% of the questions of
    100k training items verbatim, so pass `train_questions(...)` to hold out only unseen ones.
    """
    if source == "gsm8k":
        items = unseen(load_gsm8k("test"), exclude_questions)
        if n > len(items):
            raise ValueError(f"GSM8K test has {len(items)} usable items, asked for {n}")
        return items[:n]
    if source == "gsm_symbolic":
        size = n
        while len(items := unseen(gsm_symbolic_items(HELDOUT_SYMBOLIC_SEED, size), exclude_questions)) < n:
            size *= 2  # item i does not depend on size, so a larger draw extends the smaller one
        return items[:n]
    raise ValueError(f"unknown held-out source {source!r}; valid: {', '.join(HELDOUT_SOURCES)}")


def train_items(n_symbolic: int) -> list[dict]:
    """The training items: GSM8K train then `n_symbolic` gsm_symbolic items of `TRAIN_SYMBOLIC_SEED`."""
    if n_symbolic >= HELDOUT_SYMBOLIC_SEED - TRAIN_SYMBOLIC_SEED:
        raise ValueError(f"n_symbolic={n_symbolic} would reach the held-out seed {HELDOUT_SYMBOLIC_SEED}")
    symbolic = gsm_symbolic_items(TRAIN_SYMBOLIC_SEED, n_symbolic) if n_symbolic else []
    return load_gsm8k("train") + symbolic


def train_questions(n_symbolic: int) -> set[str]:
    """The questions of `train_items(n_symbolic)`, to exclude from held-out sets."""
    return {item["question"] for item in train_items(n_symbolic)}


def training_text(item: dict) -> str:
    """Prompt then solution; EOS is appended as an id by `build_token_stream`, not as text."""
    return format_prompt(item["question"]) + " " + item["solution"]


def build_token_stream(items: Iterable[dict], codec: TextCodec, dtype: type = np.uint16) -> np.ndarray:
    """Concatenation of encode(training_text(item)) + [eos] over `items` (uint16 by default: the training stream)."""
    if codec.vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"vocab size {codec.vocab_size} does not fit in {np.dtype(dtype).name}")
    items = list(items)
    parts = [
        np.asarray([*codec.encode(training_text(item)), codec.eos_id], dtype=dtype)
        for item in tqdm(items, desc="tokenize")
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def pack_batches(stream: np.ndarray, seq_len: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Endless int64 batches [batch_size, seq_len] of windows at uniform random offsets in `stream`."""
    if len(stream) < seq_len:
        raise ValueError(f"stream has {len(stream)} tokens, fewer than seq_len={seq_len}")
    offsets = np.arange(seq_len)
    while True:
        starts = rng.integers(0, len(stream) - seq_len + 1, size=batch_size)
        yield stream[starts[:, None] + offsets].astype(np.int64)


def tokenizer_sample(texts: list[str], n_keep: int, size: int, seed: int = 0) -> list[str]:
    """The first `n_keep` texts (GSM8K, the diverse part) plus a random sample of the others, `size` in all."""
    n_draw = min(max(size - n_keep, 0), len(texts) - n_keep)
    picks = np.random.default_rng(seed).choice(len(texts) - n_keep, size=n_draw, replace=False) + n_keep
    return texts[:n_keep] + [texts[i] for i in sorted(picks)]


def corpus_config(n_symbolic: int, vocab_size: int) -> dict:
    """The settings a corpus directory was built with."""
    return {
        "n_symbolic": n_symbolic,
        "vocab_size": vocab_size,
        "train_symbolic_seed": TRAIN_SYMBOLIC_SEED,
        "heldout_symbolic_seed": HELDOUT_SYMBOLIC_SEED,
        "heldout_per_source": HELDOUT_PER_SOURCE,
        "tokenizer_sample": TOKENIZER_SAMPLE,
        "heldout_excludes_train_questions": True,
    }


def corpus_is_complete(out_dir: Path, config: dict) -> bool:
    """True when `out_dir` holds a finished corpus built with `config`; ValueError if built with other settings."""
    meta_path = out_dir / "corpus.json"
    if not meta_path.is_file():
        return False
    built = json.loads(meta_path.read_text())["config"]
    if built != config:
        raise ValueError(f"{out_dir} was built with {built}, not {config}; delete it or use another directory")
    return all((out_dir / name).is_file() for name in ("tokenizer.json", "train_tokens.npy", "heldout_tokens.npy"))


def load_or_train_codec(path: Path, texts: list[str], vocab_size: int) -> TextCodec:
    """The tokenizer saved at `path`, else one trained on `texts` and saved there."""
    if path.is_file():
        codec = TextCodec.from_file(path)
        if codec.vocab_size > vocab_size:
            raise ValueError(f"{path} has vocab size {codec.vocab_size}, more than the requested {vocab_size}")
        return codec
    print(f"training tokenizer (vocab {vocab_size}) on {len(texts)} texts")
    codec = TextCodec(train_tokenizer(texts, vocab_size))
    codec.save(path)
    return codec


def prepare_corpus(out_dir: Path, n_symbolic: int = 100_000, vocab_size: int = 2048) -> Path:
    """Build tokenizer.json, train_tokens.npy, heldout_tokens.npy and corpus.json in `out_dir` (reused if built)."""
    out_dir = Path(out_dir)
    config = corpus_config(n_symbolic, vocab_size)
    if corpus_is_complete(out_dir, config):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    items = train_items(n_symbolic)
    n_gsm8k = len(items) - n_symbolic
    sample = tokenizer_sample([training_text(item) for item in items], n_gsm8k, TOKENIZER_SAMPLE)
    codec = load_or_train_codec(out_dir / "tokenizer.json", sample, vocab_size)
    seen = {item["question"] for item in items}
    heldout = {source: heldout_items(source, HELDOUT_PER_SOURCE, seen) for source in HELDOUT_SOURCES}
    train_stream = build_token_stream(items, codec)
    heldout_parts = {source: build_token_stream(part, codec) for source, part in heldout.items()}
    heldout_stream = np.concatenate(list(heldout_parts.values()))
    for name, stream in (("train_tokens.npy", train_stream), ("heldout_tokens.npy", heldout_stream)):
        write_atomic(out_dir / name, lambda path, stream=stream: save_array(path, stream))
    meta = corpus_meta(config, codec, n_gsm8k, n_symbolic, train_stream, heldout_parts)
    write_text_atomic(out_dir / "corpus.json", json.dumps(meta, indent=2) + "\n")  # written last: marks completion
    return out_dir


def save_array(path: Path, array: np.ndarray) -> None:
    """``np.save`` to exactly ``path`` (it would add ``.npy`` to a name without it)."""
    with Path(path).open("wb") as handle:
        np.save(handle, array)


def corpus_meta(
    config: dict,
    codec: TextCodec,
    n_gsm8k: int,
    n_symbolic: int,
    train_stream: np.ndarray,
    heldout_parts: dict[str, np.ndarray],
) -> dict:
    """Contents of corpus.json: settings, item and token counts, and each held-out source's token range."""
    ranges, start = {}, 0
    for source, part in heldout_parts.items():
        ranges[source] = [start, start + len(part)]
        start += len(part)
    return {
        "config": config,
        "vocab_size": codec.vocab_size,
        "train": {"gsm8k_items": n_gsm8k, "gsm_symbolic_items": n_symbolic, "tokens": len(train_stream)},
        "heldout": {"items_per_source": HELDOUT_PER_SOURCE, "tokens": start, "token_ranges": ranges},
    }
