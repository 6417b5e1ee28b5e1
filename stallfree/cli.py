"""The full `stallfree` command: `stallfree.entrypoints.cli`'s commands plus `bench`.

It lives here, above both, because `stallfree.entrypoints` never imports `stallfree.bench`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from stallfree.entrypoints import cli as runtime_cli
from stallfree.entrypoints.flags import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    from stallfree import __version__
    from stallfree.bench.flags import DESCRIPTION, add_bench_arguments

    parser = runtime_cli.build_parser()
    parser.add_argument("--version", action="version", version=f"stallfree {__version__}")
    bench = runtime_cli.subparsers(parser).add_parser(
        "bench",
        help="load-test and compare overlap modes",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add_bench_arguments(bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # an unknown flag exits 2 with the usage of its subcommand (`runtime_cli.parse`)
    args = runtime_cli.parse(build_parser(), argv)
    if args.command == "bench":
        from stallfree.bench.cli import run_bench

        return run_bench(args)
    return runtime_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
