"""The ``asyncgrpo`` command: ``serve``, ``train``, ``eval``, ``report`` and ``demo``.

asyncgrpo serve MODEL [--port 8000] ...            # vLLM-protocol server on CPU or GPU (dir or hub id)
asyncgrpo train --config run.yaml [--max_steps 3]  # a training run described by a YAML file
asyncgrpo eval --model DIR --config run.yaml       # score a checkpoint on the YAML's held-out sets
asyncgrpo report RUN_DIR                           # the run doctor: plots, report.html, verdicts
asyncgrpo demo                                     # the README's main job
asyncgrpo --version                                # this version, with Python's, torch's and transformers'

A mistake in the input (config, dataset, reward path, unreachable server) prints one message and exits
with code 2; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from asyncgrpo.cli.help_format import DefaultsFormatter
from asyncgrpo.errors import UserError


def version_line() -> str:
    """``asyncgrpo X (python Y, torch Z, transformers W)``, from the installed metadata (nothing imported)."""
    import platform
    from importlib import metadata

    from asyncgrpo import __version__

    def installed(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    deps = ", ".join(f"{d} {installed(d)}" for d in ("torch", "transformers"))
    return f"asyncgrpo {__version__} (python {platform.python_version()}, {deps})"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncgrpo", description=__doc__.splitlines()[0], formatter_class=DefaultsFormatter
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)

    from asyncgrpo.server.main import add_serve_arguments

    serve = sub.add_parser(
        "serve",
        help="run the embedded generation server (vLLM 0.33 HTTP protocol)",
        formatter_class=DefaultsFormatter,
    )
    add_serve_arguments(serve)
    # train and eval parse their own arguments (HfArgumentParser over AsyncGRPOConfig): see main().
    sub.add_parser(
        "train", help="run async GRPO from a YAML config (asyncgrpo train --help lists every field)", add_help=False
    )
    sub.add_parser("eval", help="score a model on the YAML's held-out sets (asyncgrpo eval --help)", add_help=False)

    from asyncgrpo.report import add_report_arguments

    report = sub.add_parser("report", help="the run doctor: curves, report.html and diagnosis of a run's metrics")
    add_report_arguments(report)

    from asyncgrpo.cli.demo import add_demo_arguments

    demo = sub.add_parser("demo", help="the short demo run on SmolLM2-135M-Instruct with the embedded server")
    add_demo_arguments(demo)
    for p in (report, demo):
        p.add_argument("--debug", action="store_true", help="show the traceback of user errors")
    return parser


def _dispatch(argv: list[str]) -> tuple[Callable[[], int], bool]:
    """The command to run and whether --debug was given."""
    debug = "--debug" in argv
    if argv and argv[0] == "train":
        from asyncgrpo.cli.launch import run_train

        return lambda: run_train(argv[1:]), debug
    if argv and argv[0] == "eval":
        from asyncgrpo.cli.eval import run_eval

        return lambda: run_eval(argv[1:]), debug
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        from asyncgrpo.server.main import run_serve

        return lambda: run_serve(args), debug
    if args.command == "report":
        from asyncgrpo.report import run_report

        return lambda: run_report(args), debug
    if args.command == "demo":
        from asyncgrpo.cli.demo import run_demo

        return lambda: run_demo(args), debug
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    from asyncgrpo.server import lean_imports
    from asyncgrpo.server.bytecode import keep_bytecode

    keep_bytecode()  # before torch and transformers: where the image turns bytecode off, keep it in our cache
    lean_imports.enable()  # our command's process: its imports of transformers may leave out scikit-learn
    command, debug = _dispatch(argv)
    try:
        return command()
    except UserError as e:
        if debug:
            raise
        name = argv[0] if argv else "asyncgrpo"
        print(f"asyncgrpo {name}: error: {e}\n(run with --debug for the traceback)", file=sys.stderr, flush=True)
        return 2
