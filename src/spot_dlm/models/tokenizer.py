"""Byte-level BPE tokenizer with one token per digit and fixed special-token ids.

`<pad>` = 0, `<eos>` = 1 and `<mask>` = 2 always; every other id comes from BPE training. The byte-level
alphabet is always in the vocabulary, so any text encodes and `decode(encode(text)) == text` exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
MASK_TOKEN = "<mask>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, MASK_TOKEN)  # in id order
PAD_ID, EOS_ID, MASK_ID = 0, 1, 2

PROMPT_TEMPLATE = "Question: {question}\nAnswer:"


def format_prompt(question: str) -> str:
    """The prompt the model sees for `question`; the solution follows after a space."""
    return PROMPT_TEMPLATE.format(question=question)


def special_token_errors(tokenizer: Tokenizer) -> list[str]:
    """Descriptions of every special token whose id is not the fixed one (empty when all are right)."""
    errors = []
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual_id = tokenizer.token_to_id(token)
        if actual_id != expected_id:
            errors.append(f"{token} has id {actual_id}, expected {expected_id}")
    return errors


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> Tokenizer:
    """Train a byte-level BPE tokenizer (digits split one per token) with the special tokens at ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    errors = special_token_errors(tokenizer)
    assert not errors, errors
    return tokenizer


@dataclass(frozen=True)
class TextCodec:
    """Text <-> token ids. Special-token strings inside text are encoded as plain text, never as control ids."""

    tokenizer: Tokenizer

    def __post_init__(self) -> None:
        errors = special_token_errors(self.tokenizer)
        if errors:
            raise ValueError("tokenizer special tokens are wrong: " + "; ".join(errors))
        # A literal "<eos>" in a question must not become the EOS id.
        self.tokenizer.encode_special_tokens = True

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @property
    def mask_id(self) -> int:
        return MASK_ID

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special token added."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_prompt(self, question: str) -> list[int]:
        """Token ids of the prompt for `question`."""
        return self.encode(format_prompt(question))

    @classmethod
    def from_file(cls, path: str | Path) -> TextCodec:
        """Load a tokenizer saved by `save`; errors name the file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed JSON
            raise ValueError(f"cannot read tokenizer file {path}: {exc}") from exc
        try:
            return cls(tokenizer)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as JSON, creating parent directories."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path))
