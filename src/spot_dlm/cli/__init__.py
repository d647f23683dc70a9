"""``spot-dlm`` command line: one small parser function per subcommand, grouped by what the subcommand does
(``decoding``, ``benchmarks``, ``drafting``, ``training``); the work itself lives in the library."""

from __future__ import annotations

import argparse
import sys

from spot_dlm.cli import benchmarks, decoding, drafting, training


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spot-dlm", description="Exact speculative decoding for diffusion LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (decoding, benchmarks, drafting, training):
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"spot-dlm: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # long commands keep what they finished and say what in the message
        detail = f"; {stop}" if str(stop) else ""
        print(f"spot-dlm: interrupted{detail}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
