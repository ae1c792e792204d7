"""The engine thread: a command queue drained between steps, pause states, and the step itself.

New requests have a queue of their own, drained even while a step decoded ahead is in flight: queuing one
changes nothing that step uses. Every other command waits until no step is in flight.

Everything here runs on one thread (or inline in the caller before that thread
starts), so scheduler, cache and sequences need no locks. Other threads only
post commands (the records of ``commands.py``, each with a future) and wait on the
future when they must. This is the engine's core; ``engine.py`` is the facade that
builds it and that callers use.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from asyncgrpo.server.engine.commands import Abort, AddSequence, LoopCommand, Pause, Resume, RunCall, Stop
from asyncgrpo.server.engine.request import PauseMode
from asyncgrpo.server.engine.runner import ModelRunner
from asyncgrpo.server.engine.sampler import PendingSample, Sampler, SamplerRow
from asyncgrpo.server.engine.scheduler import Batch, Scheduler, Sequence

logger = logging.getLogger(__name__)

_NO_BAN: list[int] = []  # shared, never mutated
IDLE_WAIT_S = 0.05  # how long the idle engine thread sleeps before re-checking its queue


def _make_blas_handles(device: torch.device) -> None:
    """One small matmul and one with a bias (cuBLAS and cuBLASLt) on this thread, outside any CUDA graph capture.
    Why: torch makes a thread's BLAS handles at its first matmul, or takes ones a finished thread left; made while
    the thread captures a graph, they fail the capture. Without this, a first step that only replays graphs captured
    at the start (a long first prefill) left the thread without handles for its first idle capture."""
    try:
        a = torch.ones(16, 16, device=device)
        torch.addmm(a[0], a, a)
        torch.mm(a, a)
        torch.cuda.current_stream(device).synchronize()
    except RuntimeError as exc:  # the steps make them instead (the idle captures wait for the first one)
        logger.debug("BLAS handles not made at the engine thread's start: %s", exc)


def _next(q: queue.SimpleQueue) -> tuple[LoopCommand, Future] | None:
    """The next command in ``q`` and its future, or None when it is empty (never blocks)."""
    try:
        return q.get_nowait()
    except queue.Empty:
        return None


class EngineLoop:
    """Owns the step loop of :class:`~asyncgrpo.server.engine.engine.Engine`."""

    def __init__(
        self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, eos_token_ids: list[int], max_model_len: int
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.device = runner.device
        self.weight_version = "0"
        self.pause_mode: PauseMode | None = None
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.on_release: Any = None  # called with a request id when a request finishes
        # diagnostics: steps and wall seconds (incl. the sampler's device sync) per step kind
        self.step_counts = {"prefill": 0, "decode": 0}
        self.step_seconds = {"prefill": 0.0, "decode": 0.0}
        self.step_last_end_unix = {"prefill": 0.0, "decode": 0.0}  # wall clock: benchmarks time what follows a step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # New requests wait here, apart from the other commands: adding one to the waiting queue touches nothing a
        # step in flight uses, so it never stops the engine from decoding ahead (a server fed by a rollout worker
        # receives a request nearly every step; as a command, each one ended the step ahead).
        self._submits: queue.SimpleQueue = queue.SimpleQueue()
        self.decode_steps_ahead = 0  # diagnostics: decode steps launched before the previous step's results
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stepped_once = False  # the engine thread ran a step: its idle captures may start (_capture_idle)
        self._inline = threading.Lock()  # serialises command handling while no thread runs
        self._seqs: dict[str, Sequence] = {}
        self._drain_waiters: list[Future] = []
        self._stopping = False
        self.look_ahead = True  # decode one step ahead in steady decode phases (see _step)
        self._last_step_end = 0.0
        self._pending: tuple[Batch, PendingSample, str, float] | None = None

    # ----------------------------------------------------------- other threads
    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="asyncgrpo-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        if self.running():
            self.send(Stop())
            self._thread.join(timeout=timeout)  # type: ignore[union-attr]
        else:
            self.send(Stop())

    def send(self, cmd: LoopCommand) -> Future:
        """Post ``cmd``; handled on the engine thread, or right here if it is not running."""
        fut: Future = Future()
        if self.running():
            (self._submits if isinstance(cmd, AddSequence) else self._commands).put((cmd, fut))
            self._wake.set()
        else:
            with self._inline:
                self._handle(cmd, fut)
        return fut

    def call(self, cmd: LoopCommand, timeout: float | None) -> Any:
        """:meth:`send` and wait for the answer (re-raising an error raised on the engine thread)."""
        fut = self.send(cmd)
        if not fut.done() and not self.running():
            name = type(cmd).__name__.lower()
            raise RuntimeError(f"{name} cannot complete before the engine thread runs; call start() first")
        return fut.result(timeout=timeout)

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            _make_blas_handles(self.device)
        with torch.no_grad():
            while not self._stopping:
                self._wake.clear()
                self._drain_submits()
                if self._pending is not None and not self._commands.empty():
                    self._finish_pending()  # commands run between steps: nothing may be in flight
                self._drain_commands()
                if self._stopping:
                    break
                stepped = self._pending is not None or self._can_step()
                if stepped:
                    try:
                        self._step()
                        self._stepped_once = True
                    except Exception:  # a scheduler bug must not kill the thread silently
                        logger.exception("engine step crashed; aborting the requests in flight")
                        self._abort_all(error="engine step crashed (see the server log)")
                self._resolve_drain_waiters()
                if not stepped and not self._capture_idle():
                    self._wake.wait(IDLE_WAIT_S)
        logger.info("engine thread stopped")

    def _capture_idle(self) -> bool:
        """Nothing to run: capture one more CUDA graph (``ModelRunner.capture_idle``) unless paused; whether one was.
        A request that arrives meanwhile waits one capture (about 10 ms). Only once this thread has run a step: a
        thread's cuBLAS handle is made at its first matmul, and made inside a capture it fails it (an H100 run,
        2026-12-06: the first idle capture after the start failed and dropped every graph). The thread makes its
        handles when it starts (:func:`_make_blas_handles`); the first step is the second guard."""
        if self.pause_mode is not None or not self._commands.empty() or not self._stepped_once:
            return False
        capture = getattr(self.runner, "capture_idle", None)  # test runners may lack it
        return bool(capture()) if capture is not None else False

    def _drain_commands(self) -> None:
        while (item := _next(self._commands)) is not None:
            self._drain_submits()  # a request sent before this command (its abort, a pause) is known first
            self._handle(*item)

    def _drain_submits(self) -> None:
        while (item := _next(self._submits)) is not None:
            self._handle(*item)

    def _handle(self, cmd: LoopCommand, fut: Future) -> None:
        try:
            match cmd:
                case AddSequence(seq=seq):
                    self._seqs[seq.request_id] = seq
                    self.prompt_tokens += seq.prompt_len
                    self.scheduler.add(seq)
                case Abort(request_id=request_id):
                    seq = self._seqs.get(request_id)
                    if seq is not None:
                        self._finish(seq, "abort")
                case Pause(mode=mode, clear_cache=clear_cache):
                    self._pause(mode, clear_cache, fut)
                    return
                case Resume():
                    self.pause_mode = None
                    self._resolve_drain_waiters(force=True)
                case RunCall(fn=fn):
                    fut.set_result(fn())
                    return
                case Stop():
                    self._stopping = True
                    self._abort_all()
                case _:
                    raise TypeError(f"not an engine command: {cmd!r}")
            fut.set_result(None)
        except Exception as exc:  # e.g. a failing run_between_steps fn: goes back to its caller
            logger.debug("engine command %s failed", type(cmd).__name__, exc_info=True)
            if not fut.done():
                fut.set_exception(exc)

    def _abort_all(self, error: str | None = None) -> None:
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort", error=error)

    def preempt_for_new_weights(self) -> None:
        """What a ``keep`` pause with cleared caches does (vLLM 0.33, ``v1/engine/core.py``): the frozen requests are
        preempted, so their KV is recomputed with whatever weights are loaded by the next step. Engine thread only."""
        self.scheduler.preempt_all()
        self.scheduler.kv.reset_prefix_cache()

    def _pause(self, mode: PauseMode, clear_cache: bool, fut: Future) -> None:
        self.pause_mode = mode
        if mode == "abort":
            self._abort_all()
        if mode == "keep" and clear_cache:
            self.preempt_for_new_weights()
        if mode == "wait" and self.scheduler.running:
            self._drain_waiters.append(fut)  # answered once the running sequences are done
        else:
            fut.set_result(None)

    def _resolve_drain_waiters(self, force: bool = False) -> None:
        if self._drain_waiters and (force or not self.scheduler.running):
            for fut in self._drain_waiters:
                if not fut.done():
                    fut.set_result(None)
            self._drain_waiters.clear()

    def _can_step(self) -> bool:
        if self.pause_mode in ("abort", "keep"):
            return False
        return self.scheduler.has_work(admit=self.pause_mode is None)

    def _step(self) -> None:
        """Run one step. A decode step may launch the next one *before* its own results reach the host (the
        sampled tokens feed it on the device), so the host bookkeeping of step k overlaps the GPU work of k+1."""
        if self._pending is None:
            start = time.perf_counter()
            batch = self.scheduler.schedule(admit=self.pause_mode is None)
            if batch is None:
                return
            try:
                sample = self._launch(batch)
            except Exception as exc:  # fail the affected requests, keep the engine alive
                logger.exception("engine step failed for %d requests", len(batch.seqs))
                self._fail(batch, exc)
                return
            self._pending = (batch, sample, self.weight_version, start)
        self._finish_pending(look_ahead=True)

    def _launch(self, batch: Batch, next_tokens: torch.Tensor | None = None) -> PendingSample:
        lora = any(s.lora is not None for s in batch.seqs)
        ahead = 0 if next_tokens is None else 1
        if batch.is_prefill:
            logits = self.runner.prefill(batch.seqs, lora)
        else:
            logits = self.runner.decode(batch.seqs, lora, next_tokens)
        return self.sampler.launch(logits, [self._sampler_row(s, ahead) for s in batch.seqs])

    def _finish_pending(self, look_ahead: bool = False) -> None:
        """Bring the step in flight to the host and apply it; first launch the next decode step when allowed."""
        batch, sample, version, start = self._pending  # type: ignore[misc]
        self._pending = None
        ahead = self._look_ahead_seqs(batch, sample) if look_ahead else None
        if ahead:
            t0 = time.perf_counter()
            try:
                tokens = sample.tokens
                if len(ahead) < len(batch.seqs):  # rows of sequences this step finishes by length are dropped
                    keep = {id(s) for s in ahead}
                    rows = [i for i, s in enumerate(batch.seqs) if id(s) in keep]
                    tokens = tokens.index_select(0, torch.tensor(rows, device=tokens.device))
                nxt = Batch(is_prefill=False, seqs=ahead)
                self._pending = (nxt, self._launch(nxt, tokens), version, t0)
                self.decode_steps_ahead += 1
            except Exception:
                logger.exception("decoding one step ahead failed; stepping synchronously from now on")
                self.look_ahead = False
                self._pending = None
        try:
            result = sample.result()
        except Exception as exc:
            logger.exception("engine step failed for %d requests", len(batch.seqs))
            self._pending = None  # the step ahead read this step's tokens
            self._fail(batch, exc)
            return
        live = sum(1 for s in batch.seqs if not s.finished)
        self.generation_tokens += live
        self._record_step("prefill" if batch.is_prefill else "decode", start, live)  # before any answer goes out
        done = []
        top_ids, top_values, spans = result.top_ids, result.top_values, result.top_spans
        for row, (seq, token, lp, mask) in enumerate(zip(batch.seqs, result.token_ids, result.logprobs, result.masks)):
            if seq.finished:  # finished (or aborted) while this step was in flight: its token is dropped
                continue
            seq.append(token, lp, version)
            if seq.top_counts is not None:
                span = spans[row]
                if span is None:
                    seq.top_counts.append(0)
                else:
                    a, k = span
                    seq.top_ids.extend(top_ids[a : a + k])  # type: ignore[union-attr]
                    seq.top_values.extend(top_values[a : a + k])  # type: ignore[union-attr]
                    seq.top_counts.append(k)
            if seq.sampling_mask is not None:
                seq.sampling_mask.append(mask or [])
            stop = self._stop_reason(seq, token)
            if stop is not None:
                done.append((seq, stop))
        for seq, stop in done:
            self._finish(seq, *stop)

    def _record_step(self, kind: str, start: float, live: int) -> None:
        """Count a step and its wall time. Called before the step's answers are handed out, so a client that
        times its answer's arrival never sees the step end later; a step ahead whose rows all finished while
        it ran (no live token) leaves the last-step clock alone."""
        self.step_counts[kind] += 1
        if kind == "decode":
            self.scheduler.note_decode_step()
        now = time.perf_counter()
        self.step_seconds[kind] += now - max(start, self._last_step_end)  # steps ahead overlap: count wall time once
        if live:
            self.step_last_end_unix[kind] = time.time()
        self._last_step_end = now

    def _look_ahead_seqs(self, batch: Batch, sample: PendingSample) -> list[Sequence] | None:
        """The sequences to decode one step ahead, or None. Only in a steady decode phase: no admission due, no
        command queued, no adapter, no repetition penalty (it reads the token ids). Sequences that this step
        ends by length are left out; one that stops on EOS wastes its row of the step ahead."""
        if not self.look_ahead or batch.is_prefill or self.pause_mode is not None or self.scheduler.admission_due():
            return None
        if not (sample.deferred or self.device.type == "cpu") or not self._commands.empty():
            return None
        out = []
        for s in batch.seqs:
            p = s.request.params
            if s.finished or s.lora is not None or p.repetition_penalty != 1.0:
                return None
            n = len(s.token_ids) + 1  # after this step's token
            if n - s.prompt_len < p.max_tokens and n < self.max_model_len:
                out.append(s)
        if not out or not self.scheduler.reserve_ahead(out):
            return None
        return out

    def _fail(self, batch: Batch, exc: Exception) -> None:
        self.scheduler.kv.reset_prefix_cache()  # blocks keyed for this step may hold no valid K/V
        for seq in batch.seqs:
            self._finish(seq, "abort", error=f"engine step failed: {type(exc).__name__}: {exc}")

    def _sampler_row(self, seq: Sequence, ahead: int = 0) -> SamplerRow:
        """The sequence's sampler row, built once and updated in place each step (cheap at batch 256).
        ``ahead``: tokens sampled but not yet appended (the row is for the step after them)."""
        row = seq.sampler_row
        n = len(seq.token_ids) - seq.prompt_len + ahead
        if row is None:
            p = seq.request.params
            ban = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            ids = seq.token_ids if p.repetition_penalty != 1.0 else []  # the live list: grows with the sequence
            row = seq.sampler_row = SamplerRow(params=p, num_output=n, token_ids=ids, banned=ban)
            seq.min_tokens_ban = ban
        row.num_output = n
        row.banned = seq.min_tokens_ban if n < row.params.min_tokens else _NO_BAN
        return row

    def _stop_reason(self, seq: Sequence, token: int) -> tuple[str, int | None] | None:
        """vLLM's order: nothing stops before min_tokens; then EOS, stop ids, max_tokens, max_model_len."""
        p = seq.request.params
        total = len(seq.token_ids)
        n = total - seq.prompt_len
        if n >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return ("stop", None)
            if token in p.stop_token_ids:
                return ("stop", token)
        if n >= p.max_tokens or total >= self.max_model_len:
            return ("length", None)
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | None = None, error: str | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        self.scheduler.remove(seq)
        self._seqs.pop(seq.request_id, None)
        if self.on_release is not None:
            self.on_release(seq.request_id)
        try:
            seq.on_finish(seq.to_output(reason, stop_reason, error))
        except Exception:
            logger.exception("on_finish callback of request %s raised", seq.request_id)
