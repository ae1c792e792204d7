"""``asyncgrpo train --config FILE.yaml [--max_steps 3 ...]``: a training run described by one YAML file.

    model: demo                      # "demo" (SmolLM2-135M-Instruct, offline), a local dir or a hub id
    dataset:                         # a reasoning-gym task ...
      recipe: reasoning_gym
      task: chain_sum
      size: 256
    # dataset: {path: my_data.jsonl} # ... or anything `datasets.load_dataset` opens (path, name, split)
    eval_dataset: {recipe: reasoning_gym, task: chain_sum, size: 64, seed: 1}   # optional held-out set
    reward_funcs:                    # import paths, "module:function" or "module.function"
      - asyncgrpo.tasks.reasoning:reasoning_gym_reward
    server:                          # optional: start the embedded server for this run
      embedded: true
      device: cpu
      args: ["--max-num-seqs", "64"] # any other `asyncgrpo serve` flags
    args:                            # AsyncGRPOConfig fields; the command line overrides them
      output_dir: outputs/demo
      max_steps: 20

Without ``server.embedded`` the run uses ``args.vllm_server_base_url``. The whole file is checked before
anything starts (``asyncgrpo.cli.run_config``); the final model and tokenizer are always saved to ``output_dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo.cli.run_config import RunSpec, check_args, check_run, did_you_mean, load_yaml
from asyncgrpo.cli.run_server import await_embedded, launch_embedded, wait_for_server
from asyncgrpo.errors import UserError

if TYPE_CHECKING:
    from asyncgrpo.server.launcher import ServerProcess

__all__ = ["build_dataset", "parse_train", "run_train", "train_from_config"]

logger = logging.getLogger(__name__)


def build_dataset(spec: dict[str, Any]):
    """The ``datasets.Dataset`` a checked ``dataset`` section describes; plain-text prompts in ``prompt_column``
    become one user message each (the trainer takes conversational prompts)."""
    spec = dict(spec)
    try:
        if spec.pop("recipe", None) == "reasoning_gym":
            from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

            return reasoning_gym_dataset(**spec)
        from datasets import load_dataset

        path, column = spec.pop("path"), spec.pop("prompt_column", None)
        split = spec.pop("split", "train")
        if Path(path).suffix in (".json", ".jsonl"):
            ds = load_dataset("json", data_files=path, split=split, **spec)
        else:
            ds = load_dataset(path, split=split, **spec)
    except (ValueError, TypeError, OSError) as e:
        raise UserError(f"dataset {spec}: cannot build it: {e}") from e
    if column is not None:
        if column not in ds.column_names:
            raise UserError(f"dataset.prompt_column '{column}' is not a column; columns: {ds.column_names}")
        ds = ds.map(lambda row: {"prompt": [{"role": "user", "content": str(row[column])}]})
    return ds


def build_eval(spec: RunSpec) -> Any:
    """The held-out data a run's YAML asks for: one dataset (``eval_dataset``), named ``EvalSet``s
    (``eval_datasets``), or None."""
    if spec.eval_sets:
        from asyncgrpo.tasks.eval_sets import EvalSet

        return {name: EvalSet(build_dataset(e["dataset"]), e["reward_funcs"], e["num_samples"], e["temperature"],
                              e.get("environment_factory"), e.get("tools"), e.get("max_tool_calling_iterations"))
                for name, e in spec.eval_sets.items()}  # fmt: skip
    return build_dataset(spec.eval_dataset) if spec.eval_dataset is not None else None


def resolve_model(name: str) -> str:
    """A local directory for ``name``: the demo model, a directory, or a hub id through the HF cache (as serve)."""
    if name == "demo":
        from asyncgrpo.assets import demo_model_dir

        return str(demo_model_dir())
    from asyncgrpo.server.startup_checks import StartupError, resolve_model_dir

    try:
        return resolve_model_dir(name)
    except StartupError as e:
        raise UserError(f"model: {e}") from e


# ---- the command line ------------------------------------------------------------------------------------------------
def import_config() -> None:
    """Import ``AsyncGRPOConfig``, and with it transformers, peft and transformers' modeling stack, as the command
    does: where this process is the ``asyncgrpo`` command's (``cli.main`` says so), without the packages they
    never call here (``server/lean_imports.py``: scikit-learn, which transformers <= 5.17 imports with its
    generation code; 0.5 s of the trainer's start on a CPU machine). The YAML's reward modules were imported
    before (``check_run``): a user's import is never hidden."""
    from asyncgrpo.server import lean_imports

    with lean_imports.without_unused_packages():
        import asyncgrpo.config  # noqa: F401


def train_parser(prog: str = "asyncgrpo train", description: str | None = None):
    """HfArgumentParser over AsyncGRPOConfig (every field a --flag with its help) plus the command's own flags;
    returns the parser and the group of the command's own flags."""
    import_config()
    from transformers import HfArgumentParser

    from asyncgrpo.config import AsyncGRPOConfig

    # conflict_handler="resolve": our --debug (tracebacks) replaces TrainingArguments' --debug flag; that field
    # (underflow_overflow, ...) stays settable in the YAML's args.
    description = description or (
        "Run async GRPO from a YAML file; any AsyncGRPOConfig field below overrides "
        "the file's args (e.g. --max_steps 3 --learning_rate 1e-5)."
    )
    parser = HfArgumentParser(AsyncGRPOConfig, prog=prog, conflict_handler="resolve", description=description)
    debug_default = next(f.default for f in dataclasses.fields(AsyncGRPOConfig) if f.name == "debug")
    parser.set_defaults(debug=debug_default)  # HfArgumentParser expects every field in the namespace
    own = parser.add_argument_group(prog)
    own.add_argument("--config", required=True, help="the run's YAML file (see examples/demo.yaml)")
    own.add_argument("--debug", dest="show_traceback", action="store_true", help="show the traceback of user errors")
    if not prog.endswith("train"):  # asyncgrpo eval: no run to resume or to log
        return parser, own
    own.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        help="resume from a checkpoint folder; alone: the newest in output_dir; 'auto': the newest if any, else "
        "start fresh (for jobs restarted after a crash or preemption)",
    )
    own.add_argument("--log-full", action="store_true", help="print transformers' whole metrics dict every window")
    own.add_argument(
        "--doctor-every",
        type=int,
        default=10,
        help="print the run doctor's verdicts every N logging windows (0: never; default: 10)",
    )
    return parser, own


def config_yaml(argv: list[str]) -> dict[str, Any] | None:
    """The YAML named by ``--config`` (top-level keys checked), or None when there is none or help is asked for."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config is None or {"-h", "--help"} & set(argv):
        return None
    return load_yaml(known.config)


def parse_train(
    argv: list[str],
    prog: str = "asyncgrpo train",
    description: str | None = None,
    add_flags: Any = None,
    help_sections: tuple[dict[str, tuple[str, ...]], str] | None = None,
) -> tuple[RunSpec, argparse.Namespace]:
    """Read --config, check the whole YAML, apply command-line overrides; nothing is loaded or started.

    The sections but ``args`` are checked first, before transformers is imported (seconds), so most mistakes
    are reported at once. ``add_flags(parser)`` adds a command's own flags (``asyncgrpo eval --model``);
    ``help_sections`` (sections, note on the rest): the fields its ``--help`` lists (``help_format.organize_help``).
    """
    sections = None
    cfg = config_yaml(argv)
    if cfg is not None:
        args_raw = cfg["args"] or {}
        if not isinstance(args_raw, dict):
            raise UserError(f"args must be a mapping of AsyncGRPOConfig fields, got {args_raw!r}")
        sections = check_run(cfg)
    from asyncgrpo.cli.help_format import organize_help

    parser, own = train_parser(prog, description)
    if add_flags is not None:
        add_flags(own)
    model = " --model DIR" if add_flags is not None else ""
    shown, rest_note = help_sections if help_sections is not None else (None, None)
    organize_help(parser, own, f"{prog} --config FILE.yaml{model} [options] [--FIELD VALUE ...]", shown, rest_note)
    if sections is None:
        parser.parse_args(argv)  # --help, or argparse's own "--config is required" (exit 2)
    parser.set_defaults(**check_args(args_raw))
    try:
        config, ns, rest = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    except ValueError as e:  # AsyncGRPOConfig.__post_init__ lists every problem with its fix
        raise UserError(str(e)) from e
    if rest:
        flags = [o for a in parser._actions for o in a.option_strings]
        hint = did_you_mean(rest[0].split("=")[0], flags) if rest[0].startswith("-") else ""
        raise UserError(f"unknown command-line argument(s) {' '.join(rest)}{hint}; `{parser.prog} --help` lists them")
    return dataclasses.replace(sections, args=config), ns


def _config_from_dict(cfg: dict[str, Any], sections: RunSpec | None = None) -> RunSpec:
    sections = sections if sections is not None else check_run(cfg)
    import_config()  # after the reward modules, as train_parser
    from asyncgrpo.config import AsyncGRPOConfig

    try:
        args = AsyncGRPOConfig(**check_args(dict(cfg["args"])))
    except ValueError as e:
        raise UserError(str(e)) from e
    return dataclasses.replace(sections, args=args)


@dataclasses.dataclass
class Ahead:
    """What a run starts once its YAML's sections are checked, before ``AsyncGRPOConfig``'s imports (transformers,
    peft: 3-6 s), so that those overlap them: the embedded server, and the rollout worker's process, whose own
    imports (4 s on a GPU machine) delayed step 1 by 3.4 s when the trainer spawned it after loading its model
    (bench/LOG.md, issue 41). Both are stopped with the run's stack (a no-op for what the trainer stopped)."""

    server: ServerProcess | None = None
    worker: Any = None  # a RolloutWorker spawned without its loop (first rank only), for the trainer to adopt


def start_ahead(stack: contextlib.ExitStack, sections: RunSpec) -> Ahead:
    from asyncgrpo.rollout.worker import RolloutWorker

    ahead = Ahead()
    if sections.server.get("embedded"):
        ahead.server = launch_embedded(stack, resolve_model(sections.model), sections.server)
    if int(os.environ.get("RANK", "0")) == 0:  # the other ranks of a sharded run generate nothing
        worker = ahead.worker = RolloutWorker(None)
        worker.spawn()

        def stop(exc_type: Any, *_: Any) -> None:
            if exc_type is not None and not worker.started and worker.process is not None:
                worker.process.terminate()  # a bad flag: its error waits neither for the child's imports nor a loop
            worker.stop()

        stack.push(stop)
    return ahead


def train_from_spec(spec: RunSpec, resume: str | bool | None = None, progress: Any = None,
                    ahead: Ahead | None = None) -> tuple[Any, Any]:  # fmt: skip
    """Run one checked training job; returns (``TrainOutput``, the trainer). The final model is always saved.

    ``progress`` replaces transformers' progress callback (a ``ProgressCallback`` subclass) when given; ``ahead``:
    what :func:`start_ahead` started already (else it is started here, still before the data and the trainer).
    """
    from asyncgrpo import AsyncGRPOTrainer
    from asyncgrpo.errors import ServerError

    args, server_cfg = spec.args, spec.server
    if not server_cfg.get("embedded"):
        for url in args.server_urls:
            wait_for_server(url, float(server_cfg.get("wait_s", 60)))
    model = resolve_model(spec.model)
    with contextlib.ExitStack() as stack:
        ahead = ahead if ahead is not None else start_ahead(stack, spec)
        server, early_worker = ahead.server, ahead.worker
        if server is not None:
            args.vllm_server_base_url = server.base_url
        dataset = build_dataset(spec.dataset)
        eval_dataset = build_eval(spec)
        kwargs = {"eval_dataset": eval_dataset} if eval_dataset is not None else {}
        try:
            trainer = AsyncGRPOTrainer(
                model=model, reward_funcs=list(spec.reward_funcs), args=args, train_dataset=dataset, **kwargs
            )
        except ServerError as e:
            raise UserError(f"the generation server at {args.vllm_server_base_url} did not answer: {e}") from e
        if early_worker is not None and trainer.worker_ahead is None and trainer.rollout_worker is None:
            early_worker.heartbeat_timeout = args.rollout_worker_timeout
            trainer.worker_ahead = early_worker  # train() hands it its rollout loop
        elif early_worker is not None:  # the trainer generates otherwise (a TRL rollout worker): not needed
            early_worker.stop()
        if server is not None:
            trainer.warm_up_compile(until=server.answers)  # while the server starts (CUDA; trainer/warmup.py)
            await_embedded(server)
        # run_config.json (written by the trainer at train() start) records the YAML's sections too
        trainer.run_info.update(model=spec.model, dataset=spec.dataset, reward_funcs=list(spec.reward_specs))
        if progress is not None:
            from asyncgrpo.report.live import install_compact_progress

            install_compact_progress(trainer, progress)
        out = trainer.train(resume_from_checkpoint=resume)
        if not trainer.final_model_saved:  # save_strategy="no": a run from the command line still leaves its model
            trainer.save_model(args.output_dir)
        return out, trainer


def train_from_config(cfg: dict[str, Any], resume: str | bool | None = None, progress: Any = None) -> Any:
    """A run from a YAML-shaped dict (``asyncgrpo demo``); returns the ``TrainOutput``."""
    with contextlib.ExitStack() as stack:
        sections = check_run(cfg)
        ahead = start_ahead(stack, sections)
        return train_from_spec(_config_from_dict(cfg, sections), resume, progress, ahead)[0]


def wants_mps(argv: list[str]) -> bool:
    """The YAML of ``--config`` asks for MPS (``server: {embedded: true, mps: true}``); read before anything
    initializes CUDA (building the config may), since a process joins MPS only at its first CUDA call."""
    cfg = config_yaml(argv)
    server = (cfg or {}).get("server") or {}
    return isinstance(server, dict) and server.get("mps") is True and server.get("embedded") is True


def run_train(argv: list[str]) -> int:
    with contextlib.ExitStack() as stack:
        if wants_mps(argv):
            from asyncgrpo.server.mps import MpsUnavailable, mps_daemon

            try:
                stack.enter_context(mps_daemon())
            except MpsUnavailable as e:
                raise UserError(str(e)) from e
        return _run_train(argv)


def _run_train(argv: list[str]) -> int:
    with contextlib.ExitStack() as stack:
        cfg = config_yaml(argv)  # None: --help, or no --config (parse_train says so)
        return _train_command(argv, start_ahead(stack, check_run(cfg)) if cfg is not None else None)


def _train_command(argv: list[str], ahead: Ahead | None) -> int:
    spec, ns = parse_train(argv)

    from asyncgrpo.report.live import CompactProgress, settings_of

    if ns.doctor_every < 0:
        raise UserError(f"--doctor-every {ns.doctor_every}: must be >= 0 (0 turns the verdicts off)")
    a = spec.args
    progress = None if ns.log_full else CompactProgress(ns.doctor_every, settings_of(a))
    t0 = time.time()
    out, _ = train_from_spec(spec, ns.resume, progress, ahead)
    print(run_summary(a.output_dir, out.global_step, t0), flush=True)
    return 0


def run_summary(output_dir: str, steps: int, t0: float) -> str:
    """The closing line, from this run's windows in metrics.jsonl (what was logged, whatever was printed)."""
    from asyncgrpo.report.live import summary
    from asyncgrpo.report.runlog import METRICS_FILE, read_windows

    path = Path(output_dir, METRICS_FILE)
    windows = [w for w in read_windows(path) if w.get("time", 0) >= t0] if path.is_file() else []
    return summary(windows, steps, time.time() - t0, output_dir)
