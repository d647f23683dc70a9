"""Benchmark rows: a method with, optionally, some of its drafter's switches set.

A row reads ``METHOD`` or ``METHOD:key=value:key=value``, e.g. ``spot:token_lm=on:order_model=small``. The keys are
the ``GenerateConfig`` fields listed in ``ROW_OPTIONS``; each value is parsed by its field's type (``on``/``off``
for switches). The row's label in tables and JSON is the text as written.
"""

from __future__ import annotations

import dataclasses

from spot_dlm.api import METHODS, ORDER_MODEL_SIZES, GenerateConfig

ROW_OPTIONS = (  # the GenerateConfig fields a bench row may set (ablations of the speculative methods)
    "confidence_prior",
    "token_survival",
    "neighbour_tokens",
    "neighbour_prior",
    "token_lm",
    "handoffs",
    "order_model",
)
THRESHOLD_FAMILY = {  # speculative threshold methods (and the bench's sets oracle) -> the rule they equal
    **{name: method.exact_to for name, method in METHODS.items() if method.drafter and method.rule != "one"},
    "sets-oracle": "threshold",
}
_SWITCH_VALUES = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerateConfig) if f.name in ROW_OPTIONS}


def parse_row(row: str) -> tuple[str, dict]:
    """``"spot:token_lm=on"`` -> ``("spot", {"token_lm": True})``; a ValueError names what is wrong."""
    method, *settings = row.split(":")
    if not method:
        raise ValueError(f"bench row {row!r}: no method before ':'")
    options: dict = {}
    for setting in settings:
        key, sep, text = setting.partition("=")
        if not sep or not text:
            raise ValueError(f"bench row {row!r}: {setting!r} is not key=value")
        if key not in ROW_OPTIONS:
            raise ValueError(f"bench row {row!r}: unknown option {key!r}; choose from {', '.join(ROW_OPTIONS)}")
        if key in options:
            raise ValueError(f"bench row {row!r}: {key} is set twice")
        options[key] = _option_value(row, key, text)
    return method, options


def _option_value(row: str, key: str, text: str):
    default = _DEFAULTS[key]
    if isinstance(default, bool):
        if text.lower() not in _SWITCH_VALUES:
            raise ValueError(f"bench row {row!r}: {key} is on or off, got {text!r}")
        return _SWITCH_VALUES[text.lower()]
    if isinstance(default, float):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"bench row {row!r}: {key} is a number, got {text!r}") from None
    if key == "order_model" and text not in ORDER_MODEL_SIZES:
        raise ValueError(f"bench row {row!r}: order_model is one of {', '.join(ORDER_MODEL_SIZES)}, got {text!r}")
    return text


def threshold_family(row: str) -> str | None:
    """The drafter-free threshold rule a row is compared with (None: compared with standard decoding)."""
    method = parse_row(row)[0]
    return THRESHOLD_FAMILY.get(method) or (method if method in ("threshold", "dynamic") else None)
