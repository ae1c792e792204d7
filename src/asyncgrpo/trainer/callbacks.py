"""Trainer callbacks: what happens between optimizer steps, and the metrics file (G10, T3, T5, M1–M4).

``AsyncGRPOCallback`` runs on every rank after each optimizer step: it asks the
trainer to push the weights every ``weight_sync_steps`` (``sync_weights``: the
push and the version hand-over to the worker), accounts for the trained prompts,
fills the step's ``perf/*`` metrics from the trainer's ``StepStats`` and stops the
run when the prompts of ``num_train_epochs`` are consumed. It sees the trainer only
through :class:`TrainerSeam`, public attributes and methods.
``MetricsFileCallback`` appends every logged window to
``<output_dir>/metrics.jsonl`` (one JSON object per line with ``step`` and ``time``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Protocol

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.report.runlog import RUN_CONFIG_FILE
from asyncgrpo.trainer.checkpoint import write_rollout_state
from asyncgrpo.trainer.rollout_source import RolloutSource
from asyncgrpo.trainer.step_stats import StepStats
from asyncgrpo.trainer.warmup_stats import StartupMetrics

logger = logging.getLogger(__name__)


class TrainerSeam(Protocol):
    """What the callbacks use of ``AsyncGRPOTrainer`` (declared here so this file never imports the trainer)."""

    state: Any
    run_info: dict[str, Any]  # what run_config.json records besides the config (model, reward functions, dataset)
    callback_handler: Any
    window: MetricsWindow
    step_stats: StepStats
    source: RolloutSource | None  # rank 0 only
    facts: Any  # ServerFacts once train() probed the server (its ready_s: perf/server_ready_s)

    def is_world_process_zero(self) -> bool: ...

    def sync_weights(self) -> None: ...

    def start_rollout_worker(self) -> None: ...

    def share_from_rank_zero(self, obj: Any) -> Any: ...


class AsyncGRPOCallback(TrainerCallback):
    def __init__(self, trainer: TrainerSeam) -> None:
        self.trainer = trainer
        self.startup = StartupMetrics()  # perf/time_to_first_step_s, server_ready_s, warmup_share, recompiles

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Always push first: the server may hold any weights (a previous run's, another checkpoint, its own start
        # after a resume), and nothing it reports proves they are this policy's. Adapter sync: registers the adapter.
        self.trainer.sync_weights()
        if self.trainer.is_world_process_zero():
            self.trainer.start_rollout_worker()  # only now: its first samples carry the weights just restored

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._optimizer_t0 = time.perf_counter()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Without a device sync this is the launch time on a GPU; the step's sync points bound the error.
        self.trainer.step_stats.optimizer_s = time.perf_counter() - getattr(self, "_optimizer_t0", time.perf_counter())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer
        if state.global_step % args.weight_sync_steps == 0:
            tr.sync_weights()
        finished = False
        if tr.is_world_process_zero():
            if tr.source is None:
                raise RuntimeError(
                    "AsyncGRPOCallback.on_step_end: the trainer has no rollout source (train() not running)"
                )
            trained_tokens = tr.source.step_done(tr.step_stats.micro_batches)
            tr.step_stats.record(tr.window, trained_tokens, args.world_size)
            # transformers' DefaultFlowCallback, always the first callback, has set should_log for this step
            self.startup.step_done(tr.window, state.global_step, tr.step_stats.step_durations, control.should_log,
                                   tr.facts.ready_s if tr.facts is not None else None)  # fmt: skip
            n = tr.source.dataset_len
            if n:
                state.epoch = tr.source.prompts_consumed / n
            finished = tr.source.finished
            self._refresh_progress_total(state)
        if args.world_size > 1:  # only rank 0 knows; every process must leave the loop at the same step
            finished, epoch = tr.share_from_rank_zero((finished, state.epoch))
            state.epoch = epoch
        if finished:
            control.should_training_stop = True
        if control.should_training_stop and control.should_save and _off_save_grid(args, state.global_step):
            control.should_save = False  # transformers' extra save at the last step: train() saves the model instead

    def _refresh_progress_total(self, state: Any) -> None:
        """Epoch mode: re-estimate the number of steps from prompts consumed so far (the bar's ETA)."""
        src = self.trainer.source
        if src is None or src.total_prompts is None or state.global_step == 0 or src.prompts_consumed == 0:
            return
        estimate = math.ceil(state.global_step * src.total_prompts / src.prompts_consumed)
        for cb in self.trainer.callback_handler.callbacks:
            bar = getattr(cb, "training_bar", None) if isinstance(cb, ProgressCallback) else None
            if bar is not None and estimate != bar.total:
                bar.total = max(estimate, state.global_step)
                bar.refresh()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer
        if tr.is_world_process_zero() and tr.source is not None:
            ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if os.path.isdir(ckpt):
                first, settled = tr.source.checkpoint_state()
                num_tokens = tr.step_stats.num_tokens_total
                write_rollout_state(ckpt, first, tr.source.dataset_len, settled, state.global_step, num_tokens,
                                    tr.source.pools_state())  # fmt: skip

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        tr = self.trainer
        if not (args.log_completions and tr.is_world_process_zero() and tr.source is not None):
            return
        from rich.console import Console
        from rich.table import Table

        groups = list(tr.source.completions_log)
        tr.source.completions_log.clear()
        table = Table(title=f"completions at step {state.global_step}", show_lines=True)
        for col in ("prompt", "completion", "reward"):
            table.add_column(col, overflow="fold")
        rows = [(g.prompt_text, c, r) for g in groups for c, r in zip(g.completion_texts or [], g.rewards or [])]
        limit = args.num_completions_to_print
        for prompt, completion, reward in rows[: limit if limit is not None else len(rows)]:
            table.add_row(prompt or "", completion, f"{reward:.3f}")
        Console().print(table)


def _off_save_grid(args: Any, step: int) -> bool:
    """The step is not one ``save_strategy="steps"`` asked for (transformers also saves at the last step)."""
    every = args.save_steps
    if args.save_strategy != "steps" or every is None or every < 1:
        return False
    return step % int(every) != 0 and args.world_size == 1  # several processes: train() saves no final model


class MetricsFileCallback(TrainerCallback):
    """Writes the run's settings to ``<output_dir>/run_config.json`` at the start and appends each logging window to
    ``<output_dir>/metrics.jsonl`` (rank 0): ``asyncgrpo report`` reads both, however the run was started."""

    def __init__(self, trainer: TrainerSeam) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.trainer.is_world_process_zero():
            return
        os.makedirs(args.output_dir, exist_ok=True)
        record = {**self.trainer.run_info, "args": json.loads(args.to_json_string())}
        with open(os.path.join(args.output_dir, RUN_CONFIG_FILE), "w") as fh:
            json.dump(record, fh, indent=1, default=str)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if not self.trainer.is_world_process_zero() or not logs:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        record = {"step": state.global_step, "time": time.time(), **logs}
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
