"""Where a run's start goes, in the trainer's process: the first call of each phase, seconds since launch.

``install(t_launch)`` wraps the phases of a run's start (trainer construction, the compile warm-up, the graph
captures, the rollout worker's spawn and hand-over, the server probe, the first weight push, the first batch
and step) so that the first call of each records when it began and ended. Bench-only: it patches the imported
modules in place, and skips a phase the measured checkout does not have (an older ``src``).
"""

from __future__ import annotations

import functools
import importlib
import time
from typing import Any

# (module, attribute path, label): attribute paths are "Class.method" or a module-level function as the caller
# sees it (``from x import f`` binds f in the caller's module, so the caller's module is patched)
PHASES = [
    ("asyncgrpo.trainer.trainer", "AsyncGRPOTrainer.__init__", "trainer_init"),
    ("asyncgrpo.trainer.trainer", "start_compile_workers", "compile_workers"),
    ("asyncgrpo.models.vlm", "load_pretrained", "model_load"),
    ("transformers.trainer", "Trainer.__init__", "hf_trainer_init"),
    ("asyncgrpo.trainer.compile", "compile_decoder_layers", "compile_wrap"),  # called by compile_for_training
    ("transformers.trainer", "Trainer._prepare_for_training", "hf_train_setup"),
    ("transformers.trainer", "Trainer.create_optimizer", "optimizer_setup"),
    ("asyncgrpo.trainer.graphed_step", "GraphedDecoder._capture", "graph_capture_one"),
    ("asyncgrpo.trainer.graphed_step", "GraphedDecoder._compare", "graph_check"),
    ("asyncgrpo.trainer.trainer", "AsyncGRPOTrainer.step_forward_backward", "step_fwd_bwd"),
    ("asyncgrpo.trainer.trainer", "AsyncGRPOTrainer.warm_up_compile", "warm_up_compile"),
    ("asyncgrpo.trainer.trainer", "warm_up", "warm_up"),
    ("asyncgrpo.trainer.graphed_step", "GraphedDecoder.capture_largest", "graph_capture_largest"),
    ("asyncgrpo.trainer.graphed_step", "GraphedDecoder.capture_all", "graph_capture"),
    ("asyncgrpo.rollout.worker", "RolloutWorker.spawn", "worker_spawn"),
    ("asyncgrpo.trainer.trainer", "AsyncGRPOTrainer.train", "train"),
    ("asyncgrpo.trainer.trainer", "read_servers", "read_servers"),
    ("asyncgrpo.trainer.trainer", "build_parts", "build_parts"),
    ("asyncgrpo.trainer.trainer", "AsyncGRPOTrainer.sync_weights", "first_weight_push"),
    ("asyncgrpo.rollout.worker", "RolloutWorker._hand_over", "worker_hand_over"),
    ("asyncgrpo.trainer.trainer", "prepare_step", "prepare_step"),
    ("asyncgrpo.trainer.trainer", "AsyncGRPOTrainer.get_batch_samples", "first_batch"),
    ("asyncgrpo.trainer.trainer", "AsyncGRPOTrainer.training_step", "first_fwd_bwd"),
    ("asyncgrpo.trainer.trainer", "finish_step_graphs", "finish_step_graphs"),
]


def resolve(module_name: str, path: str) -> tuple[Any, str, Any] | None:
    """(the object holding the phase's function, its attribute name, the function), or None where it is missing."""
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError:
        return None
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part, None)
    fn = getattr(owner, name, None) if owner is not None else None
    return (owner, name, fn) if fn is not None else None


def install(t_launch: float) -> dict[str, list[float]]:
    """Patch the phases; returns the dict they fill: label -> [start, end] of the first call (s since launch)."""
    seen: dict[str, list[float]] = {}
    for module_name, path, label in PHASES:
        found = resolve(module_name, path)
        if found is not None:
            owner, name, fn = found
            setattr(owner, name, _first_call(fn, label, seen, t_launch))
    return seen


def _first_call(fn: Any, label: str, seen: dict[str, list[float]], t0: float) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if label in seen:
            return fn(*args, **kwargs)
        start = time.time() - t0
        seen[label] = [round(start, 3), -1.0]
        try:
            return fn(*args, **kwargs)
        finally:
            seen[label][1] = round(time.time() - t0, 3)

    return wrapper
