"""The ``asyncgrpo`` command: ``serve``, ``train`` and ``demo``.

asyncgrpo serve MODEL [--port 8000] ...   # vLLM-protocol server on CPU or GPU
asyncgrpo train --config run.yaml         # a training run described by a YAML file
asyncgrpo demo                            # the README's main job
"""

from __future__ import annotations

import argparse
import logging
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    from asyncgrpo.server.main import add_serve_arguments

    serve = sub.add_parser("serve", help="run the embedded generation server (vLLM 0.33 HTTP protocol)")
    add_serve_arguments(serve)

    from asyncgrpo.launch import add_train_arguments

    train = sub.add_parser("train", help="run async GRPO from a YAML config (see asyncgrpo.launch)")
    add_train_arguments(train)

    from asyncgrpo.demo import add_demo_arguments

    demo = sub.add_parser("demo", help="the short demo run on SmolLM2-135M-Instruct with the embedded server")
    add_demo_arguments(demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _build_parser().parse_args(argv)
    if args.command == "serve":
        from asyncgrpo.server.main import run_serve

        return run_serve(args)
    if args.command == "train":
        from asyncgrpo.launch import run_train

        return run_train(args)
    if args.command == "demo":
        from asyncgrpo.demo import run_demo

        return run_demo(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
