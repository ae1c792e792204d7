"""Checks a run's YAML as a whole before anything starts, and turns it into a ``RunSpec``.

Every section is checked against what it can hold: top-level keys, ``dataset`` (a reasoning-gym task and its
settings, or a ``datasets.load_dataset`` source), ``server``, ``reward_funcs`` (imported here) and ``args``
(``AsyncGRPOConfig`` through transformers' ``HfArgumentParser``, so command-line overrides such as
``--max_steps 3`` get the same types and help). A mistake raises ``UserError`` naming the key and the fix,
with a "did you mean" when the key is close to a valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from asyncgrpo.errors import UserError

TOP_KEYS = ("model", "dataset", "eval_dataset", "eval_datasets", "reward_funcs", "server", "args")
# Beside a dataset's keys, in each eval_datasets set; the last three make it an agent set (tasks/agent_eval.py).
EVAL_SET_KEYS = (
    "num_samples",
    "temperature",
    "reward_funcs",
    "environment_factory",
    "tools",
    "max_tool_calling_iterations",
)
SERVER_KEYS = ("embedded", "device", "dtype", "args", "timeout", "wait_s", "mps")
RECIPE_KEYS = ("recipe", "task", "size", "seed", "system_prompt")
LOAD_KEYS = ("path", "name", "split", "data_files", "data_dir", "revision", "prompt_column")


def did_you_mean(word: str, options: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_keys(where: str, found: typing.Iterable[str], allowed: typing.Iterable[str]) -> None:
    allowed = list(allowed)
    for key in found:
        if key not in allowed:
            raise UserError(
                f"{where}: unknown key '{key}'{did_you_mean(str(key), allowed)}; allowed: {', '.join(allowed)}"
            )


def _mapping(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise UserError(f"{where} must be a mapping (key: value lines), got {type(value).__name__} {value!r}")
    return value


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Parse the file and check its top-level keys."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file {path} not found")
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {e}") from e
    cfg = _mapping(str(path), cfg)
    _check_keys(str(path), cfg, TOP_KEYS)
    for key in ("model", "dataset", "args"):
        if key not in cfg:
            raise UserError(f"{path}: missing '{key}' (see examples/demo.yaml)")
    return cfg


# ---- dataset ---------------------------------------------------------------------------------------------------------
def reasoning_gym_tasks() -> dict[str, type]:
    """Task name -> its settings dataclass (importing reasoning_gym registers them)."""
    import reasoning_gym  # noqa: F401 - registers the tasks
    from reasoning_gym.factory import DATASETS

    return {name: cfg_cls for name, (_, cfg_cls) in DATASETS.items()}


def check_dataset(where: str, spec: Any) -> dict[str, Any]:
    spec = _mapping(where, spec)
    if "recipe" in spec:
        if spec["recipe"] != "reasoning_gym":
            raise UserError(f"{where}.recipe: {spec['recipe']!r} is unknown; the one recipe is 'reasoning_gym'")
        tasks = reasoning_gym_tasks()
        task = str(spec.get("task", "chain_sum"))
        if task not in tasks:
            raise UserError(
                f"{where}.task: unknown reasoning-gym task '{task}'{did_you_mean(task, tasks)}; valid "
                f"tasks: {', '.join(sorted(tasks))}"
            )
        task_keys = [f.name for f in dataclasses.fields(tasks[task]) if f.name not in ("seed", "size")]
        _check_keys(f"{where} (reasoning_gym task {task})", spec, [*RECIPE_KEYS, *task_keys])
        return spec
    if "path" not in spec:
        extra = did_you_mean("recipe", spec) or did_you_mean("path", spec)
        raise UserError(
            f"{where} needs 'recipe: reasoning_gym' (with a task) or a 'path' for datasets.load_dataset{extra}"
        )
    _check_keys(where, spec, LOAD_KEYS)
    path = str(spec["path"])
    if Path(path).suffix in (".json", ".jsonl", ".csv", ".parquet") and not Path(path).is_file():
        raise UserError(f"{where}.path: file {path} not found")
    return spec


# ---- rewards ---------------------------------------------------------------------------------------------------------
def _public_callables(module: Any) -> list[str]:
    return [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]


def closest_path(module: str, name: str) -> str | None:
    """The existing ``module:function`` nearest to a path whose module does not import: the module chosen among
    asyncgrpo's public and moved modules (a moved one stands for its new path) and the submodules of the deepest
    package of ``module`` that imports, then the function among that module's callables when it is one of ours
    (other modules are not imported to guess)."""
    from asyncgrpo.import_paths import MOVED, PUBLIC_MODULES

    parts = module.split(".")
    ours = difflib.get_close_matches(parts[0], ["asyncgrpo"], cutoff=0.7)  # asyncgrpo, or a misspelling of it
    candidates = {*PUBLIC_MODULES, *MOVED} if ours else set()
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if parent in MOVED:
            continue
        try:
            package = importlib.import_module(parent)
        except ImportError:
            continue
        if hasattr(package, "__path__"):
            candidates.update(f"{parent}.{m.name}" for m in pkgutil.iter_modules(package.__path__))
        break
    close = difflib.get_close_matches(module, sorted(candidates), n=1, cutoff=0.6)
    if not close:
        return None
    found = MOVED.get(close[0], close[0])
    if found.split(".")[0] == "asyncgrpo":
        names = difflib.get_close_matches(name, _public_callables(importlib.import_module(found)), n=1)
        return f"{found}:{names[0]}" if names else found
    return f"{found}:{name}"


def import_object(spec: str, where: str = "reward_funcs") -> Any:
    """``"pkg.mod:name"`` or ``"pkg.mod.name"`` -> the object, or a UserError saying what is missing and naming
    the closest existing path. An old path (``asyncgrpo.import_paths.MOVED``) imports with one deprecation line."""
    module, _, name = spec.partition(":") if ":" in spec else spec.rpartition(".")
    if not module or not name:
        raise UserError(f"{where}: cannot import {spec!r}: write it as 'package.module:function'")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        if not (isinstance(e, ModuleNotFoundError) and e.name and module.startswith(e.name)):
            raise UserError(f"{where}: cannot import {spec!r}: {e}") from e  # the module exists but fails to import
        close = closest_path(module, name)
        hint = f" (did you mean '{close}'?)" if close else ""
        raise UserError(f"{where}: cannot import {spec!r}: no module named '{e.name}'{hint}") from e
    if not hasattr(mod, name):
        close = difflib.get_close_matches(name, _public_callables(mod), n=1, cutoff=0.6)
        hint = f" (did you mean '{module}:{close[0]}'?)" if close else ""
        raise UserError(f"{where}: cannot import {spec!r}: module {module} has no '{name}'{hint}")
    return getattr(mod, name)


# ---- args: AsyncGRPOConfig through HfArgumentParser ------------------------------------------------------------------
def _accepts(tp: Any, value: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits the annotation ``tp``; numbers written as text (YAML reads 5e-6 as a string) convert."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for member in typing.get_args(tp):
            ok, converted = _accepts(member, value)
            if ok:
                return True, converted
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp in (int, float):
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)) and (tp is float or float(value).is_integer()):
            return True, tp(value)
        if isinstance(value, str):
            try:
                return True, tp(float(value)) if tp is float else int(value)
            except ValueError:
                return False, value
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin in (list, tuple) or tp in (list, tuple):
        return isinstance(value, (list, tuple, str)), value
    if origin is dict or tp is dict:
        return isinstance(value, (dict, str)), value
    return True, value  # enums, Literal and other types: transformers checks them in __post_init__


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check_args(raw: dict[str, Any]) -> dict[str, Any]:
    """The YAML ``args`` with names checked against AsyncGRPOConfig and values against the field types."""
    from asyncgrpo.config import AsyncGRPOConfig

    hints = typing.get_type_hints(AsyncGRPOConfig)
    fields = [f.name for f in dataclasses.fields(AsyncGRPOConfig) if f.init]
    out = {}
    for key, value in raw.items():
        if key not in fields:
            raise UserError(
                f"args: '{key}' is not an AsyncGRPOConfig field{did_you_mean(key, fields)}; "
                "`asyncgrpo train --help` lists them all"
            )
        ok, converted = _accepts(hints[key], value)
        if not ok:
            raise UserError(
                f"args.{key}: {value!r} ({type(value).__name__}) does not fit its type {_type_name(hints[key])}"
            )
        out[key] = converted
    return out


@dataclass(frozen=True)
class RunSpec:
    """A checked run: everything ``asyncgrpo train`` needs, with no model loaded yet."""

    model: str
    dataset: dict[str, Any]
    eval_dataset: dict[str, Any] | None
    reward_specs: tuple[str, ...]
    reward_funcs: tuple[Any, ...]
    server: dict[str, Any]
    args: Any  # AsyncGRPOConfig (None until parsed)
    eval_sets: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # name -> check_eval_sets' entry


def check_server(spec: Any) -> dict[str, Any]:
    spec = _mapping("server", spec or {})
    _check_keys("server", spec, SERVER_KEYS)
    if "args" in spec and not isinstance(spec["args"], list):
        raise UserError(
            f"server.args must be a list of `asyncgrpo serve` flags, e.g. ['--max-num-seqs', '64'];"
            f" got {spec['args']!r}"
        )
    if "embedded" in spec and not isinstance(spec["embedded"], bool):
        raise UserError(f"server.embedded must be true or false, got {spec['embedded']!r}")
    if "mps" in spec and not isinstance(spec["mps"], bool):
        raise UserError(f"server.mps must be true or false, got {spec['mps']!r}")
    if spec.get("mps") and not spec.get("embedded"):
        raise UserError(
            "server.mps: true needs server.embedded: true (the run starts the MPS daemon before its server); for a "
            "server you start yourself, run `nvidia-cuda-mps-control -d` before starting it and the trainer"
        )
    return spec


def _reward_list(where: str, specs: Any) -> tuple[Any, ...]:
    if not isinstance(specs, list) or not all(isinstance(s, str) for s in specs):
        raise UserError(f"{where} must be a list of 'package.module:function' strings; got {specs!r}")
    rewards = tuple(import_object(s, where) for s in specs)
    if not rewards:
        raise UserError(f"{where} is empty: list at least one 'package.module:function'")
    return rewards


def check_eval_sets(raw: Any) -> dict[str, dict[str, Any]]:
    """``eval_datasets``: name -> {dataset: its checked section, num_samples, temperature, reward_funcs (or None)}."""
    out = {}
    for name, spec in _mapping("eval_datasets", raw).items():
        where = f"eval_datasets.{name}"
        spec = dict(_mapping(where, spec))
        own = {k: spec.pop(k) for k in EVAL_SET_KEYS if k in spec}
        n, t = own.get("num_samples"), own.get("temperature")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UserError(f"{where}.num_samples must be an integer >= 1, got {n!r}")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0):
            raise UserError(f"{where}.temperature must be a number >= 0 (0 is greedy), got {t!r}")
        agent = _agent_parts(where, own)
        if own.get("reward_funcs") == [] and agent["environment_factory"] is not None:
            rewards: tuple[Any, ...] | None = ()  # scored by the environment's get_reward alone
        else:
            rewards = _reward_list(f"{where}.reward_funcs", own["reward_funcs"]) if "reward_funcs" in own else None
        out[str(name)] = {"dataset": check_dataset(where, spec), "num_samples": n,
                          "temperature": None if t is None else float(t), "reward_funcs": rewards, **agent}  # fmt: skip
    if not out:
        raise UserError("eval_datasets is empty: name at least one set, e.g. sums: {recipe: reasoning_gym, ...}")
    return out


def _agent_parts(where: str, own: dict[str, Any]) -> dict[str, Any]:
    """An eval set's ``environment_factory`` ('pkg.mod:Class', or a mapping name -> path routed by the rows'
    ``environment`` column), ``tools`` (a list of paths) and ``max_tool_calling_iterations``, imported and checked."""
    from asyncgrpo.rollout.agents import check_environment_factory, check_tool, tool_names

    env, tools, turns = own.get("environment_factory"), own.get("tools"), own.get("max_tool_calling_iterations")
    factory = None
    if env is not None:
        if isinstance(env, str):
            factory = import_object(env, f"{where}.environment_factory")
        elif isinstance(env, dict) and env and all(isinstance(v, str) for v in env.values()):
            factory = {str(k): import_object(v, f"{where}.environment_factory.{k}") for k, v in env.items()}
        else:
            raise UserError(f"{where}.environment_factory must be 'package.module:Class' or a mapping name -> "
                            f"'package.module:Class'; got {env!r}")  # fmt: skip
        try:
            check_environment_factory(factory, must_pickle=False, what_name=f"{where}.environment_factory")
        except (TypeError, ValueError) as e:
            raise UserError(str(e)) from e
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(x, str) for x in tools):
            raise UserError(f"{where}.tools must be a list of 'package.module:function' strings; got {tools!r}")
        tools = [import_object(x, f"{where}.tools") for x in tools]
        try:
            for tool in tools:
                check_tool(tool)
            tool_names(tools)
        except (TypeError, ValueError) as e:
            raise UserError(f"{where}.tools: {e}") from e
    if turns is not None and (isinstance(turns, bool) or not isinstance(turns, int) or turns < 1):
        raise UserError(f"{where}.max_tool_calling_iterations must be an integer >= 1, got {turns!r}")
    if turns is not None and factory is None and not tools:
        raise UserError(f"{where}.max_tool_calling_iterations needs an environment_factory or tools in the set")
    return {
        "environment_factory": factory,
        "tools": tuple(tools) if tools else None,
        "max_tool_calling_iterations": turns,
    }


def check_run(cfg: dict[str, Any], args: Any = None) -> RunSpec:
    """Check every section but ``args`` (parsed separately into an AsyncGRPOConfig, then set on the spec)."""
    model = cfg["model"]
    if not isinstance(model, str) or not model:
        raise UserError(f"model must be 'demo', a local directory or a hub id; got {model!r}")
    if model.startswith((".", "/", "~")) and not Path(model).expanduser().is_dir():
        raise UserError(f"model: directory {model} not found")
    dataset = check_dataset("dataset", cfg["dataset"])
    eval_ds = check_dataset("eval_dataset", cfg["eval_dataset"]) if cfg.get("eval_dataset") is not None else None
    if eval_ds is not None and cfg.get("eval_datasets") is not None:
        raise UserError("give eval_dataset (one set) or eval_datasets (named sets), not both")
    eval_sets = check_eval_sets(cfg["eval_datasets"]) if cfg.get("eval_datasets") is not None else {}
    specs = cfg.get("reward_funcs") or []
    rewards = _reward_list("reward_funcs", specs)
    return RunSpec(model, dataset, eval_ds, tuple(specs), rewards, check_server(cfg.get("server")), args, eval_sets)
