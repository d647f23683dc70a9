"""Stand-in tokenizers: a small byte-level BPE padded with filler tokens so special tokens sit at their real ids."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# The BPE merges are learnt from this text, so ordinary English and arithmetic encode to base-vocabulary ids.
BASE_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A cat sat on the mat and the dog ran to the park.",
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? Answer: 48 / 2 = 24, and 48 + 24 = 72.",
    "Let me think step by step. First we add the numbers, then we multiply the result by two and subtract one.",
    "Write a function that returns the sum of a list of numbers. def add(a, b): return a + b",
    "You are a helpful assistant. Please answer the question below with a short explanation.",
    "What is the capital of France? The capital of France is Paris. It is a city with a long history.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 one two three four five six seven eight nine ten",
    "If there are 3 apples and you take away 2, how many apples do you have? You have 2 apples.",
    "The answer is 42. This is because the total cost is the price times the number of items.",
)
BASE_VOCAB_SIZE = 512

QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + QWEN_TEMPLATE
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerSpec:
    """Special tokens by real id, the named roles (bos/eos/pad/mask token strings) and a chat template."""

    vocab_size: int
    specials: dict[int, str]
    roles: dict[str, str] = field(default_factory=dict)
    chat_template: str | None = None


def _base_model() -> dict:
    """The byte-level BPE vocabulary and merges learnt from BASE_CORPUS (deterministic)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(BASE_CORPUS, trainer)
    return json.loads(tokenizer.to_str())["model"]


def full_vocab(base: dict[str, int], vocab_size: int, specials: dict[int, str]) -> dict[str, int]:
    """The base vocabulary, then each remaining id holds its special token or a filler ``<|filler_i|>``."""
    vocab = dict(base)
    for token_id in range(len(base), vocab_size):
        vocab[specials.get(token_id, f"<|filler_{token_id}|>")] = token_id
    return vocab


def build_tokenizer(spec: TokenizerSpec):
    """A ``PreTrainedTokenizerFast`` over ``spec.vocab_size`` ids with the special tokens at their given ids."""
    from transformers import PreTrainedTokenizerFast

    base = _base_model()
    if min(spec.specials) < len(base["vocab"]):
        raise ValueError("special token ids must lie above the base vocabulary")
    vocab = full_vocab(base["vocab"], spec.vocab_size, spec.specials)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(merge) for merge in base["merges"]]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in spec.specials.values()]
    )
    extra = [token for token in spec.specials.values() if token not in spec.roles.values()]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        chat_template=spec.chat_template,
        extra_special_tokens=extra,
        **spec.roles,
    )
