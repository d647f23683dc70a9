"""budget auto: the prior without a measurement, the measured budget after ``calibrate``, every explicit budget
honoured, and a cache that is per device and target and never breaks decoding."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from spot_dlm.api import GenerateConfig, load_target, with_budget
from spot_dlm.budget import PRIOR, cache_path, calibrate, choose_budget, store_measurement
from spot_dlm.cli import main


@pytest.fixture()
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPOT_DLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_without_a_measurement_auto_is_the_device_kinds_prior(own_cache: Path, checkpoint_dir: Path) -> None:
    target, _ = load_target(checkpoint_dir)
    choice = choose_budget(target, 0.0)
    assert (choice.budget, choice.reason) == (PRIOR["cpu"], "prior") and "spot-dlm calibrate" in choice.describe()
    assert with_budget(GenerateConfig(method="spot"), target).budget == PRIOR["cpu"]
    assert with_budget(GenerateConfig(method="spot", budget=7), target).budget == 7  # explicit budgets are honoured


def test_a_measurement_is_kept_per_temperature_kind_and_target(own_cache: Path, checkpoint_dir: Path) -> None:
    target, _ = load_target(checkpoint_dir)
    assert store_measurement(target, 1.0, {2: 0.9, 4: 1.2, 8: 1.1}) == 4
    assert choose_budget(target, 0.7).budget == 4 and choose_budget(target, 0.7).reason == "measured"
    assert choose_budget(target, 0.0).reason == "prior"  # greedy was not measured
    builtin, _ = load_target("builtin")
    assert choose_budget(builtin, 1.0).reason == "prior"  # another target
    cache_path().write_text("{not json")
    assert choose_budget(target, 1.0).reason == "prior"  # an unreadable cache is measured again, not an error


def test_calibrate_measures_and_caches_the_fastest_budget(own_cache: Path, checkpoint_dir: Path) -> None:
    target, codec = load_target(checkpoint_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shipped drafter's fits belong to another vocabulary
        table = calibrate(target, codec, ["what is 3 + 4?"], 0.0, gen_length=32, candidates=(2, 3))
    assert set(table) == {2, 3} and all(ratio > 0 for ratio in table.values())
    choice = choose_budget(target, 0.0)
    assert choice.reason == "measured" and choice.budget == max(table, key=table.get)
    with pytest.raises(ValueError, match="at least one prompt"):
        calibrate(target, codec, [], 0.0)


def test_cli_budget_auto_says_what_it_chose(own_cache: Path, checkpoint_dir: Path, capsys) -> None:
    args = ["generate", "--model", str(checkpoint_dir), "--prompt", "what is 3 + 4?", "--gen-length", "32"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*args, "--method", "spot"]) == 0
    assert "budget auto -> 2 (cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--method", "spot", "--budget", "many"])
    assert exit_info.value.code == 2 and "whole number or auto" in capsys.readouterr().err
