"""Trainer callbacks: what happens between optimizer steps, and the metrics file (G10, T3, T5, M1–M4).

``AsyncGRPOCallback`` runs on every rank after each optimizer step: it accounts
for the trained prompts, pushes the weights every ``weight_sync_steps`` and hands
the new policy version to the worker, fills the step's ``perf/*`` metrics and
stops the run when the prompts of ``num_train_epochs`` are consumed.
``MetricsFileCallback`` appends every logged window to
``<output_dir>/metrics.jsonl`` (one JSON object per line with ``step`` and ``time``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from asyncgrpo.metrics import mfu
from asyncgrpo.trainer.checkpoint import write_rollout_state
from asyncgrpo.weights.policy import join_policy_gathers

if TYPE_CHECKING:
    from asyncgrpo.trainer.trainer import AsyncGRPOTrainer

logger = logging.getLogger(__name__)


class AsyncGRPOCallback(TrainerCallback):
    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer

    # ---- weight sync
    def sync_weights(self) -> None:
        tr = self.trainer
        model = tr.model  # the sender merges a PEFT adapter itself
        step = tr.state.global_step
        if not tr.is_world_process_zero():
            join_policy_gathers(model)  # sharded parameters gather collectively, in the sender's order
            return
        assert tr.sender is not None and tr.worker is not None
        timings = tr.sender.update_model(model, version=f"step-{step}")  # one full tensor at a time
        tr.worker.set_policy_version(step)
        w = tr.window
        w.add("perf/weight_sync_s", timings["pause_s"] + timings["barrier_s"] + timings["transfer_s"])
        w.add("perf/weight_sync_pause_s", timings["pause_s"])
        w.add("perf/weight_sync_barrier_s", timings["barrier_s"])
        w.add("perf/weight_sync_transfer_s", timings["transfer_s"])

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step > 0:  # resumed: the server still serves the weights it started with
            self.sync_weights()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        tr = self.trainer
        sync_s = 0.0
        if state.global_step % args.weight_sync_steps == 0:
            t0 = time.perf_counter()
            self.sync_weights()
            sync_s = time.perf_counter() - t0
        if not tr.is_world_process_zero():
            return
        assert tr.source is not None
        trained_tokens = tr.source.step_done(getattr(tr, "_step_micro", []))
        step_s = time.perf_counter() - tr._step_t0 + sync_s
        w = tr.window
        w.add("perf/step_s", step_s)
        w.add("perf/fwd_bwd_s", tr._fwd_bwd_s)
        forwarded = tr._forwarded * args.world_size
        w.add_ratio("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, tr._fwd_bwd_s)
        w.add_ratio("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        w.add_ratio("perf/wall_clock_trained_tokens_per_s", trained_tokens, step_s)
        w.add("num_tokens", float(forwarded))
        if tr._peak and tr._flops_per_token and tr._fwd_bwd_s > 0:
            w.add("perf/fwd_bwd_mfu", mfu(forwarded, tr._flops_per_token, tr._fwd_bwd_s, tr._peak, args.world_size))
            w.add("perf/wall_clock_mfu", mfu(forwarded, tr._flops_per_token, step_s, tr._peak, args.world_size))
        n = tr.source.dataset_len
        if n:
            state.epoch = tr.source.prompts_consumed / n
        if tr.source.finished:
            control.should_training_stop = True
        self._refresh_progress_total(state)

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
                write_rollout_state(ckpt, tr.source.first_untrained, tr.source.dataset_len)

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


class MetricsFileCallback(TrainerCallback):
    """Appends each logging window to ``<output_dir>/metrics.jsonl`` (rank 0)."""

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if not self.trainer.is_world_process_zero() or not logs:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        record = {"step": state.global_step, "time": time.time(), **logs}
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as fh:
            fh.write(json.dumps(record, default=float) + "\n")
