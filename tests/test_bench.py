"""The benchmark: answer extraction, run_bench on a tiny random target, the report table, plots and the CLI (one
module, longer than most: they share the tiny target and its trained drafter folder)."""

from __future__ import annotations

import json
import shlex
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from spot_dlm.api import GenerateConfig, generate
from spot_dlm.bench.output import best_budget_lines, best_budgets, format_table, reproduce_command, round_ending_lines
from spot_dlm.bench.plots import acceptance_by_depth, plot_report
from spot_dlm.bench.rows import THRESHOLD_FAMILY
from spot_dlm.bench.run import SPECULATIVE, BenchConfig, longest_repeat, run_bench
from spot_dlm.cli import build_parser, main
from spot_dlm.drafters.calibrated import save_rank_counts
from spot_dlm.drafters.folder import save_order_model
from spot_dlm.drafters.order_net import OrderModel, OrderModelConfig
from spot_dlm.models.builtin import BuiltinTarget
from spot_dlm.tasks import extract_answer, is_correct, task_items

torch.set_num_threads(1)

# ------------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has 72 left.\n#### 72", 72.0),
        ("#### 1,080", 1080.0),
        ("#### 8.0", 8.0),
        ("#### -5 degrees", -5.0),
        ("The answer is #### $1,000.50", 1000.5),
        ("steps 3 + 4 = 7 #### 7\nextra 99", 7.0),
        ("#### .5", 0.5),
        ("no marker, 42", None),
        ("#### no number here", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: float | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "answer", "expected"),
    [
        ("#### 72", "72", True),
        ("#### 8.0", "8", True),
        ("#### 1,080", "1080", True),
        ("#### 1080", "1,080", True),
        ("#### 71", "72", False),
        ("the answer is 72", "72", False),
        ("#### 72", None, None),
        ("#### 72", "seventy-two", False),
    ],
)
def test_is_correct(text: str, answer: str | None, expected: bool | None) -> None:
    assert is_correct(text, answer) is expected


def test_acceptance_by_depth() -> None:
    assert acceptance_by_depth({"1": 2, "3": 2}, 4) == [1.0, 0.5, 0.5, 0.0]
    assert acceptance_by_depth({}, 3) == [0.0, 0.0, 0.0]


def test_bench_config_validation() -> None:
    with pytest.raises(ValueError, match="task"):
        BenchConfig(tasks=("mmlu",))
    with pytest.raises(ValueError, match="n_prompts"):
        BenchConfig(n_prompts=0)
    with pytest.raises(ValueError, match="budgets"):
        BenchConfig(budgets=(0, 4))


# ------------------------------------------------------------------------------------------- run_bench

METHODS = ("standard", "spot", "stale", "chain", "calibrated", "oracle", "threshold", "stale-sets")
BUDGETS = (2, 4)
TEMPERATURES = (0.0, 1.0)
TAU = 0.1  # low enough that threshold decoding of the random target commits several positions per pass
ROW_KEYS = {
    "target_passes",
    "generated_tokens",
    "wall_seconds",
    "tokens_per_second",
    "passes_ratio_vs_standard",
    "throughput_ratio_vs_standard",
    "exact_match_vs_standard",
    "accuracy",
    "mean_accepted",
}


@pytest.fixture(scope="module")
def bench_target(tiny_codec, model_factory) -> BuiltinTarget:
    """Vocabulary of the conftest tokenizer, context long enough for GSM8K questions."""
    model = model_factory(vocab_size=tiny_codec.vocab_size, seed=2, dtype=torch.float32, max_seq_len=512)
    return BuiltinTarget(model)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    """A random (untrained) order model plus a calibration file: enough for spot and calibrated."""
    folder = tmp_path_factory.mktemp("bench") / "drafter"
    torch.manual_seed(0)
    save_order_model(OrderModel(OrderModelConfig()).eval(), folder)
    save_rank_counts(Counter({(0,): 9, (1,): 4, (0, 0): 6, (0, 1): 2, (0, 0, 0): 3}), folder / "calibration.json")
    return folder


@pytest.fixture(scope="module")
def bench_config(drafter_dir) -> BenchConfig:
    return BenchConfig(
        methods=METHODS,
        budgets=BUDGETS,
        temperatures=TEMPERATURES,
        tasks=("gsm8k",),
        n_prompts=2,
        block_length=8,
        gen_length=16,
        depth=8,
        taus=(TAU,),
        drafter=str(drafter_dir),
    )


@pytest.fixture(scope="module")
def report(bench_config, bench_target, tiny_codec) -> dict:
    return run_bench(bench_config, target=bench_target, codec=tiny_codec, progress=False)


def find_row(rows: list[dict], **fields) -> dict:
    found = [r for r in rows if all(r[k] == v for k, v in fields.items())]
    assert len(found) == 1, (fields, found)
    return found[0]


def baseline_row(rows: list[dict], row: dict) -> dict:
    if row["baseline"] == "standard":
        return find_row(rows, task=row["task"], temperature=row["temperature"], method="standard")
    family, tau = row["baseline"].split("@")
    return find_row(rows, task=row["task"], temperature=row["temperature"], method=family, tau=float(tau))


def test_decoding_is_interleaved_prompt_by_prompt(bench_config, bench_target, tiny_codec, monkeypatch) -> None:
    """Every setting decodes prompt i before any setting decodes prompt i + 1 (warm-ups aside), baselines first:
    a slow spell of the machine then falls on all methods alike."""
    import spot_dlm.bench.run as bench_run

    calls = []
    real_generate = bench_run.generate

    def recording_generate(prompts, config, *args, first_request=None, **kwargs):
        if first_request is not None:  # warm-ups pass no request index
            calls.append((first_request, config.method, config.budget))
        return real_generate(prompts, config, *args, first_request=first_request or 0, **kwargs)

    monkeypatch.setattr(bench_run, "generate", recording_generate)
    config = BenchConfig(**{**asdict(bench_config), "methods": ("standard", "spot", "oracle"), "temperatures": (0.0,)})
    run_bench(config, target=bench_target, codec=tiny_codec, progress=False)
    prompts_in_order = [request for request, _, _ in calls]
    assert prompts_in_order == sorted(prompts_in_order)
    per_prompt = len(calls) // config.n_prompts
    assert per_prompt == 1 + 2 * len(BUDGETS)
    assert all(calls[i * per_prompt][1] == "standard" for i in range(config.n_prompts))


def test_report_layout(report: dict, bench_config: BenchConfig) -> None:
    assert tuple(report["config"]["methods"]) == METHODS
    assert report["torch_threads"] == torch.get_num_threads()
    rows = report["results"]
    expected = Counter()
    for temperature in TEMPERATURES:
        expected[("standard", None, temperature)] += 1
        expected[("threshold", None, temperature)] += 1
        for method in ("spot", "stale", "chain", "calibrated", "oracle", "stale-sets"):
            for budget in BUDGETS:
                expected[(method, budget, temperature)] += 1
    assert Counter((r["method"], r["budget"], r["temperature"]) for r in rows) == expected
    for row in rows:
        assert set(row) >= ROW_KEYS, ROW_KEYS - set(row)
        assert row["task"] == "gsm8k"
        assert row["n_prompts"] == 2
        assert row["generated_tokens"] >= 0 and row["target_passes"] > 0
        assert row["wall_seconds"] > 0 and row["tokens_per_second"] >= 0
        assert row["accuracy"] is None or 0.0 <= row["accuracy"] <= 1.0
        assert len(row["passes_per_prompt"]) == len(row["longest_repeat_per_prompt"]) == row["n_prompts"]
        assert sum(row["passes_per_prompt"]) == row["target_passes"]
    json.dumps(report)  # the report is plain JSON


def test_longest_repeat() -> None:
    assert [longest_repeat(ids) for ids in ([], [5], [1, 2, 3], [7, 7, 1, 7, 7, 7], [0] * 9 + [1])] == [0, 1, 1, 3, 9]


def test_speculative_rows_are_exact_against_their_baseline(report: dict) -> None:
    rows = report["results"]
    speculative = [r for r in rows if r["method"] in SPECULATIVE or r["method"] in THRESHOLD_FAMILY]
    assert len(speculative) == 2 * 6 * 2
    for row in speculative:
        base = baseline_row(rows, row)
        expected_baseline = f"threshold@{TAU}" if row["method"] == "stale-sets" else "standard"
        assert row["baseline"] == expected_baseline
        assert row["exact_match_vs_standard"] == 1.0, row
        assert row["generated_tokens"] == base["generated_tokens"]
        assert row["committed_tokens"] == base["committed_tokens"]
        assert row["accuracy"] == base["accuracy"]
        assert row["target_passes"] <= base["target_passes"]
        assert row["passes_ratio_vs_standard"] == pytest.approx(base["target_passes"] / row["target_passes"])
        assert row["passes_ratio_vs_standard"] >= 1.0
        assert row["mean_accepted"] >= 1.0
        ratio = row["tokens_per_second"] / base["tokens_per_second"]
        assert row["throughput_ratio_vs_standard"] == pytest.approx(ratio)
    for row in rows:
        if row["method"] in ("standard", "threshold"):
            assert row["mean_accepted"] == 1.0  # drafter-free: every pass accepts the free commit only


def test_oracle_rows_beat_standard(report: dict) -> None:
    oracle = [r for r in report["results"] if r["method"] == "oracle"]
    assert len(oracle) == len(BUDGETS) * len(TEMPERATURES)
    for row in oracle:
        assert row["passes_ratio_vs_standard"] > 1.0
        assert row["mean_accepted"] > 1.0
    for temperature in TEMPERATURES:  # a bigger budget drafts the true trajectory deeper
        small = find_row(oracle, budget=2, temperature=temperature)
        large = find_row(oracle, budget=4, temperature=temperature)
        assert large["target_passes"] < small["target_passes"]


def test_threshold_baseline_differs_from_standard(report: dict) -> None:
    """The threshold baseline is compared with standard decoding (not exact by design) and commits sets."""
    rows = report["results"]
    for temperature in TEMPERATURES:
        threshold = find_row(rows, method="threshold", temperature=temperature)
        assert threshold["baseline"] == "standard"
        assert threshold["tau"] == TAU
        assert 0.0 <= threshold["exact_match_vs_standard"] <= 1.0
    cold = find_row(rows, method="threshold", temperature=0.0)
    assert cold["target_passes"] < find_row(rows, method="standard", temperature=0.0)["target_passes"]


def test_stale_sets_tokens_equal_threshold_tokens(report, bench_target, tiny_codec, drafter_dir) -> None:
    """Independent of the report's bookkeeping: decode the bench prompts with threshold and stale-sets."""
    prompts = [item["question"] for item in task_items("gsm8k", 2)]
    common = {"block_length": 8, "gen_length": 16, "temperature": 0.0, "tau": TAU, "budget": 4, "depth": 8}
    plain = generate(prompts, GenerateConfig(method="threshold", **common), bench_target, tiny_codec)
    sets = generate(prompts, GenerateConfig(method="stale-sets", **common), bench_target, tiny_codec)
    assert [g.raw_token_ids for g in sets] == [g.raw_token_ids for g in plain]
    row = find_row(report["results"], method="stale-sets", budget=4, temperature=0.0)
    assert row["target_passes"] == sum(g.target_passes for g in sets)
    assert find_row(report["results"], method="threshold", temperature=0.0)["target_passes"] == sum(
        g.target_passes for g in plain
    )


def test_format_table_mentions_every_method(report: dict) -> None:
    table = format_table(report)
    lines = table.splitlines()
    best = best_budgets(report["results"])
    drafted = [r for r in report["results"] if r["budget"] is not None]
    assert len(lines) == 2 + len(report["results"]) + len(best) + len(drafted)
    for method in METHODS:
        assert method in table
    for line, row in zip(lines[2:], report["results"]):
        assert row["method"] in line
    tail = lines[2 + len(report["results"]) :]
    assert all(line.startswith("best budget ") for line in tail[: len(best)])
    assert all(line.startswith("rounds end ") for line in tail[len(best) :])


def test_round_endings_account_for_every_verify_pass(report: dict) -> None:
    for row in report["results"]:
        assert sum(row["round_endings"].values()) == sum(row["accepted_lengths"].values())
        if row["budget"] is None:  # drafter-free: nothing drafted, so nothing drafted was wrong
            assert set(row["round_endings"]) <= {"leaf", "block end"}
    spot = find_row(report["results"], method="spot", budget=4, temperature=0.0)
    line = next(x for x in round_ending_lines(report["results"]) if " spot 4:" in x and "T=0 " in x)
    total = sum(spot["round_endings"].values())
    assert line.endswith(f"({total})") and "wrong token" in line and "hand-off" in line


def test_best_budgets_pick_the_measured_maxima() -> None:
    def row(method, budget, passes, speed):
        return {
            "task": "t",
            "temperature": 0.0,
            "method": method,
            "tau": None,
            "budget": budget,
            "passes_ratio_vs_standard": passes,
            "throughput_ratio_vs_standard": speed,
        }

    results = [
        row("standard", None, 1.0, 1.0),
        row("spot", 2, 1.6, 1.05),
        row("spot", 4, 2.5, 0.9),
        row("spot", 16, 3.5, 0.3),
        row("stale", 4, 1.3, 0.8),
    ]
    best = best_budgets(results)
    assert set(best) == {("t", 0.0, "spot", None), ("t", 0.0, "stale", None)}
    assert best[("t", 0.0, "spot", None)]["by_tokens_per_second"]["budget"] == 2
    assert best[("t", 0.0, "spot", None)]["by_passes"]["budget"] == 16
    assert "by tokens/s 2 (1.05x tok/s, 1.60x passes); by passes 16" in "\n".join(best_budget_lines(results))


def test_plot_report_writes_three_pngs(report: dict, tmp_path: Path) -> None:
    paths = plot_report(report, tmp_path / "plots")
    assert len(paths) == 3
    assert {p.name for p in paths} == {
        "passes_ratio_vs_budget.png",
        "tokens_per_second_vs_budget.png",
        "acceptance_by_depth.png",
    }
    for path in paths:
        assert path.is_file()
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 1000


def test_run_bench_with_no_prompt_that_fits_gives_value_error(tiny_codec, model_factory) -> None:
    """A context too short for every prompt must give a clear ValueError, not a ZeroDivisionError."""
    model = model_factory(vocab_size=tiny_codec.vocab_size, seed=2, dtype=torch.float32, max_seq_len=48)
    bench = BenchConfig(
        methods=("standard",), budgets=(2,), temperatures=(0.0,), n_prompts=1, block_length=8, gen_length=16
    )
    with pytest.raises(ValueError):
        run_bench(bench, target=BuiltinTarget(model), codec=tiny_codec, progress=False)


def test_reproduce_command_parses_back_to_the_same_config(bench_config: BenchConfig) -> None:
    """The report's reproduce line must rerun the same benchmark, including the model and drafter it used."""
    bench = BenchConfig(**{**bench_config.__dict__, "model": "/some/checkpoint"})
    command = reproduce_command(bench).split("  (at ")[0]
    words = shlex.split(command)
    assert words[:2] == ["spot-dlm", "bench"]
    args = build_parser().parse_args(words[1:])
    assert tuple(args.methods) == bench.methods
    assert tuple(args.budgets) == bench.budgets
    assert tuple(args.temperatures) == bench.temperatures
    assert tuple(args.taus) == bench.taus
    assert tuple(args.task) == bench.tasks
    assert (args.n_prompts, args.block_length, args.gen_length, args.depth, args.seed) == (
        bench.n_prompts,
        bench.block_length,
        bench.gen_length,
        bench.depth,
        bench.seed,
    )
    assert args.model == bench.model
    assert args.drafter == bench.drafter


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_bench_json(checkpoint_dir: Path, drafter_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report" / "bench.json"
    plots = tmp_path / "plots"
    argv = [
        "bench",
        "--model",
        str(checkpoint_dir),
        "--drafter",
        str(drafter_dir),
        "--methods",
        "standard,spot,chain",
        "--budgets",
        "2",
        "--temperatures",
        "0",
        "--n-prompts",
        "2",
        "--block-length",
        "8",
        "--gen-length",
        "16",
        "--json",
        str(out),
        "--plots",
        str(plots),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "spot" in printed and "chain" in printed
    saved = json.loads(out.read_text())
    rows = saved["results"]
    assert rows
    assert [r["method"] for r in rows] == ["standard", "spot", "chain"]
    for row in rows:
        assert set(row) >= ROW_KEYS
        assert 1 <= row["n_prompts"] <= 2  # prompts that do not fit the checkpoint's context are skipped
        assert row["exact_match_vs_standard"] == 1.0
    assert saved["config"]["model"] == str(checkpoint_dir)
    assert saved["reproduce"].startswith("spot-dlm bench")
    assert len(list(plots.glob("*.png"))) == 3


def test_cli_bench_missing_drafter_exit_code_2(checkpoint_dir: Path, tmp_path: Path, capsys) -> None:
    argv = ["bench", "--model", str(checkpoint_dir), "--drafter", str(tmp_path / "none"), "--methods", "spot"]
    argv += ["--budgets", "2", "--temperatures", "0", "--n-prompts", "2", "--block-length", "8", "--gen-length", "8"]
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_bench_rows_set_generate_config_fields() -> None:
    from spot_dlm.bench.rows import parse_row

    assert parse_row("spot") == ("spot", {})
    assert parse_row("spot-sets") == ("spot-sets", {})
    assert parse_row("spot:confidence_prior=3") == ("spot", {"confidence_prior": 3.0})
    assert parse_row("spot:token_survival=off:neighbour_tokens=on:neighbour_prior=false") == (
        "spot",
        {"token_survival": False, "neighbour_tokens": True, "neighbour_prior": False},
    )
    assert parse_row("order-oracle:neighbour_tokens=off") == ("order-oracle", {"neighbour_tokens": False})
    assert parse_row("spot:order_model=small:handoffs=off") == ("spot", {"order_model": "small", "handoffs": False})
    assert parse_row("spot-sets:token_lm=on:handoffs=0") == ("spot-sets", {"token_lm": True, "handoffs": False})


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("spot:alternatives=2", "unknown option 'alternatives'"),
        ("spot:handoffs", "is not key=value"),
        ("spot:handoffs=", "is not key=value"),
        ("spot:handoffs=maybe", "handoffs is on or off"),
        ("spot:confidence_prior=high", "confidence_prior is a number"),
        ("spot:order_model=huge", "order_model is one of"),
        ("spot:handoffs=on:handoffs=off", "set twice"),
        (":handoffs=on", "no method"),
    ],
)
def test_bad_bench_rows_are_named(row: str, message: str) -> None:
    from spot_dlm.bench.rows import parse_row

    with pytest.raises(ValueError, match=message):
        parse_row(row)


def test_a_bad_row_fails_before_any_decoding(capsys) -> None:
    assert main(["bench", "--methods", "standard,spot:prior=3", "--budgets", "2", "--n-prompts", "1"]) == 2
    assert "unknown option 'prior'" in capsys.readouterr().err


def test_variants_of_sets_methods_are_compared_with_their_threshold_rule() -> None:
    from spot_dlm.bench.rows import threshold_family

    assert threshold_family("spot-sets:neighbour_tokens=off") == threshold_family("spot-sets") == "threshold"
    assert threshold_family("spot-sets-dynamic:neighbour_tokens=off") == "dynamic"
    assert threshold_family("spot:neighbour_tokens=off") is None and threshold_family("threshold") == "threshold"


def test_merge_reports_keeps_every_row_and_config() -> None:
    from spot_dlm.bench.output import merge_reports

    a = {"config": {"t": 0}, "machine": "m", "torch_threads": 1, "reproduce": "x", "results": [{"r": 1}]}
    b = {"config": {"t": 1}, "machine": "m", "torch_threads": 1, "reproduce": "y", "results": [{"r": 2}, {"r": 3}]}
    merged = merge_reports([a, b])
    assert merged["results"] == [{"r": 1}, {"r": 2}, {"r": 3}]
    assert merged["config"] == [{"t": 0}, {"t": 1}]
    with pytest.raises(ValueError):
        merge_reports([])
