"""``asyncgrpo train --config FILE.yaml``: a training run described by one YAML file.

    model: demo                      # "demo" (SmolLM2-135M-Instruct, offline), a local dir or a hub id
    dataset:                         # a reasoning-gym recipe ...
      recipe: reasoning_gym
      task: chain_sum
      size: 256
    # dataset: {path: my_data.jsonl} # ... or anything `datasets.load_dataset` opens (path, name, split)
    reward_funcs:                    # import paths, "module:function" or "module.function"
      - asyncgrpo.recipes.tasks:reasoning_gym_reward
    server:                          # optional: start the embedded server for this run
      embedded: true
      device: cpu
      args: ["--max-num-seqs", "64"] # any other `asyncgrpo serve` flags
    args:                            # AsyncGRPOConfig fields
      output_dir: outputs/demo
      max_steps: 20

Without ``server.embedded`` the run uses ``args.vllm_server_base_url``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

_TOP_KEYS = {"model", "dataset", "reward_funcs", "server", "args"}


def import_object(spec: str) -> Any:
    """``"pkg.mod:name"`` or ``"pkg.mod.name"`` -> the object."""
    module, _, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module or not name:
        raise ValueError(f"cannot import {spec!r}: write it as 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {spec!r}: {e}") from e


def load_run_config(path: str | Path) -> dict[str, Any]:
    cfg = yaml.safe_load(Path(path).read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: the file must hold a mapping with keys {sorted(_TOP_KEYS)}")  # noqa: TRY004
    unknown = set(cfg) - _TOP_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    for key in ("model", "dataset", "args"):
        if key not in cfg:
            raise ValueError(f"{path}: missing '{key}'")
    return cfg


def build_dataset(spec: dict[str, Any]):
    spec = dict(spec)
    if spec.pop("recipe", None) == "reasoning_gym":
        from asyncgrpo.recipes.tasks import reasoning_gym_dataset

        return reasoning_gym_dataset(**spec)
    from datasets import load_dataset

    path = spec.pop("path", None)
    if path is None:
        raise ValueError("dataset needs 'recipe: reasoning_gym' or a 'path' for datasets.load_dataset")
    split = spec.pop("split", "train")
    if Path(path).suffix in (".json", ".jsonl"):
        return load_dataset("json", data_files=path, split=split, **spec)
    return load_dataset(path, split=split, **spec)


def resolve_model(name: str) -> str:
    if name == "demo":
        from asyncgrpo.recipes import demo_model_dir

        return str(demo_model_dir())
    return name


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the run's YAML file (see `asyncgrpo.launch`)")
    parser.add_argument(
        "--resume", nargs="?", const=True, default=None, help="resume from a checkpoint (or the newest)"
    )


def train_from_config(
    cfg: dict[str, Any],
    resume: str | bool | None = None,
    callbacks: list[Any] | None = None,
    replace_progress: bool = False,
) -> Any:
    """Run one training job from a parsed config; returns the ``TrainOutput``.

    ``replace_progress`` swaps transformers' progress callback for the first of ``callbacks`` (a subclass).
    """
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.server.launcher import launch_server

    model = resolve_model(str(cfg["model"]))
    dataset = build_dataset(cfg["dataset"])
    rewards = [import_object(r) for r in cfg.get("reward_funcs", [])]
    server_cfg = cfg.get("server") or {}
    args_dict = dict(cfg["args"])
    with contextlib.ExitStack() as stack:
        if server_cfg.get("embedded"):
            extra = ["--device", str(server_cfg.get("device", "auto"))]
            if "dtype" in server_cfg:
                extra += ["--dtype", str(server_cfg["dtype"])]
            extra += [str(a) for a in server_cfg.get("args", [])]
            server = stack.enter_context(
                launch_server(model, extra_args=extra, timeout=float(server_cfg.get("timeout", 600)))
            )
            args_dict["vllm_server_base_url"] = server.base_url
        args = AsyncGRPOConfig(**args_dict)
        trainer = AsyncGRPOTrainer(model=model, reward_funcs=rewards, args=args, train_dataset=dataset)
        if replace_progress:
            from transformers.trainer_callback import ProgressCallback

            trainer.remove_callback(ProgressCallback)
        for cb in callbacks or []:
            trainer.add_callback(cb)
        return trainer.train(resume_from_checkpoint=resume)


def run_train(ns: argparse.Namespace) -> int:
    train_from_config(load_run_config(ns.config), ns.resume)
    return 0
