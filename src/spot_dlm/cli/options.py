"""Options and argument types shared by the subcommands. Each default comes from the config dataclass that owns it
(``field_default``), so it is written once."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

from spot_dlm.api import GenerateConfig, load_target
from spot_dlm.models.families import FAMILIES

BUDGET_HELP = (
    "draft nodes scored per pass: a number, or auto (default: the budget spot-dlm calibrate measured fastest here, "
    "else 2); 16 and more make fewest passes"
)


def field_default(config_class: type, name: str):
    """The default of one field of a config dataclass."""
    for field in dataclasses.fields(config_class):
        if field.name == name:
            return field.default
    raise KeyError(f"{config_class.__name__} has no field {name!r}")


def argument_default(function, name: str):
    """The default of one keyword argument of ``function``."""
    return inspect.signature(function).parameters[name].default


def budget_value(text: str) -> int | None:
    """--budget: 'auto' (None) or a whole number."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget must be a whole number or auto, got {text!r}") from None


def csv(kind):
    """An argument type: comma-separated values of ``kind``, as a tuple (empty items skipped)."""
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def worker_value(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N such as 0/2, got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"worker I/N needs 0 <= I < N, got {text!r}")
    return index, count


def add_device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto (CUDA when available)")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="builtin (default), a checkpoint folder or a transformers folder"
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="run a transformers folder's own code")
    parser.add_argument(
        "--family", choices=tuple(FAMILIES), default=None, help="the DLM family (default: from config.json)"
    )
    parser.add_argument("--shifted-logits", action="store_true", help="generic models predicting token j at j - 1")
    parser.add_argument("--mask-id", type=int, default=None, help="generic models: the mask token id")
    add_device_option(parser)
    add_device_map_option(parser)


def add_device_map_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device-map",
        default=None,
        help="transformers models larger than one GPU: accelerate's placement, e.g. auto (in place of --device; "
        "needs pip install accelerate)",
    )


def add_decoding_options(parser: argparse.ArgumentParser) -> None:
    """Model options plus block length, gen length, temperature and seed (defaults: GenerateConfig's)."""
    add_model_options(parser)
    parser.add_argument("--block-length", type=int, default=None, help="default: the model's own (built-in: 32)")
    parser.add_argument("--gen-length", type=int, default=field_default(GenerateConfig, "gen_length"))
    parser.add_argument("--temperature", type=float, default=field_default(GenerateConfig, "temperature"))
    parser.add_argument("--seed", type=int, default=field_default(GenerateConfig, "seed"))


def add_force_option(parser: argparse.ArgumentParser, replaces: str) -> None:
    parser.add_argument("--force", action="store_true", help=f"replace {replaces} (refused without it)")


def add_threads_option(parser: argparse.ArgumentParser, default: int = 0) -> None:
    parser.add_argument("--threads", type=int, default=default, help="torch threads (0: torch's default)")


def set_threads(threads: int) -> None:
    """torch's intra-op threads; 0 keeps torch's default."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def load_model(args: argparse.Namespace):
    """(target, codec) for the model options of ``add_model_options`` (under torchrun: on this rank's GPU)."""
    from spot_dlm.distributed import local_device

    hf_options = {
        "shifted_logits": args.shifted_logits,
        "mask_id": args.mask_id,
        "trust_remote_code": args.trust_remote_code,
        "family": args.family,
        "device_map": args.device_map,
    }
    return load_target(args.model, hf_options=hf_options, device=local_device(args.device))


def checkpoint_folder(name: str | None, option: str = "--init") -> Path | None:
    """'builtin' -> the built-in target's folder; a folder holding model.safetensors; None stays None."""
    if name is None:
        return None
    if name == "builtin":
        from spot_dlm.models.builtin import builtin_dir

        return builtin_dir()
    path = Path(name)
    if not (path / "model.safetensors").is_file():
        raise ValueError(f"{option}: no checkpoint in {path}")
    return path


def drafter_folder(name: str | None) -> Path | None:
    """'builtin' -> the shipped drafter folder; a path as given; None stays None."""
    if name != "builtin":
        return None if name is None else Path(name)
    from spot_dlm.drafters.folder import default_drafter_dir

    return default_drafter_dir()


def check_reports(args: argparse.Namespace, plots_option: str = "--plots") -> None:
    """A command's --json report and plots: writable, and not replacing earlier ones without --force."""
    from spot_dlm.bench.plots import PLOT_FILES
    from spot_dlm.safety import check_new_file, check_output_folder

    check_new_file(args.json, args.force, "--json")
    check_output_folder(getattr(args, "plots", None), args.force, plots_option, PLOT_FILES)
