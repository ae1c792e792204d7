"""Two run-doctor tables about where a short run's time goes: warm-up, and fixed cost per step (issue 41).

On one GPU at a small model's shape the queue, concurrency and saturation tables can all read healthy while the
run is still slow: its first steps (and any step after a recompile) take tens of seconds, and a steady step spends
its forward+backward launching kernels rather than computing. These tables name those two cases.
"""

from __future__ import annotations

import statistics

from asyncgrpo.report.runlog import RunLog
from asyncgrpo.report.verdict import Verdict, g3, pct
from asyncgrpo.step_times import SLOW_STEP_FACTOR, slow_steps, warmup_share

WARMUP_HIGH = 0.2  # warm-up (steps slower than twice the median) takes more than a fifth of the training time
# Fixed cost: forward+backward reaches less than 2 % of the GPU's peak FLOP/s, i.e. it takes more than 50 times what
# its FLOPs need, while a step's forward+backward is short (under a second): launches and Python, not arithmetic.
FIXED_COST_MFU = 0.02
FIXED_COST_FWD_BWD_S = 1.0

WARMUP_ACTION = (
    "warm the compile cache: set TORCHINDUCTOR_CACHE_DIR to a folder kept across runs, so the next run's first step "
    "loads compiled kernels instead of building them (compile_decoder_layers); cut recompiles: perf/recompiles counts "
    "them after step 1 and the trainer's warning names each one's cause; run longer (max_steps) to amortise the rest"
)
WAIT_WARMUP_ACTION = (
    "the slow steps waited for generation's first rollouts, which no compile cache shortens (the queue table says "
    "whether generation keeps up afterwards); a longer run (max_steps) amortises the start"
)
CADENCE_ACTION = (
    "raise max_staleness: more rollouts in flight (decoded in larger batches) so that generation keeps up; or add "
    "generation capacity (another server in vllm_server_base_url). The queue and concurrency tables give the waits"
)
FIXED_COST_ACTION = (
    "give each step more tokens so the fixed cost is shared: raise token_budget (more groups packed per row and "
    "step) or num_generations; set compile_decoder_layers=True (fused kernels, fewer launches)"
)


def _step_windows(run: RunLog) -> list[tuple[int, dict[str, float]]]:
    """(steps it covers, window) for each window with a ``perf/step_s`` (eval-only windows have none)."""
    out = []
    previous = 0.0
    for window in run.windows:
        if window.get("perf/step_s") is not None and window["step"] > previous:
            out.append((int(window["step"] - previous), window))
        previous = max(previous, window["step"])
    return out


def step_durations(run: RunLog) -> list[float]:
    """Each step's duration as the windows give it: a window of n steps stands for n steps of its mean
    ``perf/step_s`` (exact with ``logging_steps=1``)."""
    return [float(w["perf/step_s"]) for n, w in _step_windows(run) for _ in range(n)]


def warmup_verdict(run: RunLog, last: int) -> Verdict | None:
    """Over the whole run (warm-up sits at its start): the share of the training time in slow steps, and how much
    of those steps was waiting for samples (a generation-side warm-up, which no compile cache shortens)."""
    durations = step_durations(run)
    if len(durations) < 3:  # no median to be slower than
        return None
    _, logged = run.series("perf/warmup_share")
    share = logged[-1] if logged else warmup_share(durations)  # the trainer's figure uses every step's own time
    slow = slow_steps(durations)
    limit = SLOW_STEP_FACTOR * statistics.median(durations)
    waited = sum(n * w.get("perf/rollout_wait_s", 0.0) for n, w in _step_windows(run) if w["perf/step_s"] > limit)
    late = sum(1 for d in durations[len(durations) // 2 :] if d > limit)  # slow steps in the run's second half
    figs = {
        "perf/warmup_share": pct(share) + ("" if logged else " (from the windows' perf/step_s)"),
        "slow steps": f"{len(slow)} of {len(durations)} above {SLOW_STEP_FACTOR:g}x the median step "
        f"{g3(statistics.median(durations))} s, {g3(sum(slow))} s of {g3(sum(durations))} s",
        "perf/rollout_wait_s in slow steps": f"{g3(waited)} s",
    }
    for name in ("perf/time_to_first_step_s", "perf/server_ready_s", "perf/recompiles"):
        _, values = run.series(name)
        if values:
            figs[name] = g3(values[-1]) + (" s" if name.endswith("_s") else "")
    if share <= WARMUP_HIGH:
        return Verdict("warm-up", "warm-up is a small share of the training time", "nothing to do", True, figs)
    head = f"warm-up took {pct(share)} of the training time: steps slower than {SLOW_STEP_FACTOR:g}x the median"
    if slow and waited > sum(slow) / 2 and 3 * late >= len(slow):
        figs["slow steps in the run's second half"] = f"{late} of {len(slow)}"
        what = (
            f"not a warm-up: {pct(share)} of the training time is in steps slower than {SLOW_STEP_FACTOR:g}x the "
            f"median all through the run ({late} of {len(slow)} in its second half), mostly waiting for samples "
            f"({g3(waited)} s of {g3(sum(slow))} s): generation-bound, with rollouts that finish in bursts (a step "
            "that finds the next groups ready is fast, the one after waits for the next burst)"
        )
        return Verdict("warm-up", what, CADENCE_ACTION, False, figs)
    if slow and waited > sum(slow) / 2:
        what = f"{head} dominate a run this short, mostly waiting for samples while generation started"
        return Verdict("warm-up", what, WAIT_WARMUP_ACTION, False, figs)
    what = f"{head} (compiles, first kernels, a cold cache) dominate a run this short"
    return Verdict("warm-up", what, WARMUP_ACTION, False, figs)


def _median(run: RunLog, name: str, last: int) -> float | None:
    _, values = run.series(name, last)
    return statistics.median(values) if values else None


def fixed_cost_verdict(run: RunLog, last: int) -> Verdict | None:
    """Forward+backward against what its FLOPs need (``perf/fwd_bwd_mfu``: logged where the GPU's peak is known)."""
    mfu = _median(run, "perf/fwd_bwd_mfu", last)
    fwd_bwd = _median(run, "perf/fwd_bwd_s", last)
    if mfu is None or fwd_bwd is None:
        return None
    tokens = _median(run, "batch/forwarded_tokens_per_step", last)
    rate = _median(run, "perf/fwd_bwd_forwarded_tokens_per_s", last)
    figs = {
        "perf/fwd_bwd_mfu": f"{100 * mfu:.2g} % (median of the last windows)",
        "perf/fwd_bwd_s": f"{g3(fwd_bwd)} s",
        "batch/forwarded_tokens_per_step": "n/a" if tokens is None else g3(tokens),
        "fwd+bwd per forwarded token": "n/a" if not rate else f"{g3(1e6 / rate)} us",
    }
    if mfu < FIXED_COST_MFU and fwd_bwd < FIXED_COST_FWD_BWD_S:
        what = (
            f"forward+backward takes {g3(1 / mfu) + 'x' if mfu > 0 else 'far more than'} the time its FLOPs need "
            f"({100 * mfu:.2g} % of the GPU's peak) "
            "in a short step: the step is dominated by fixed cost (kernel launches, Python), not by its tokens"
        )
        return Verdict("fixed cost", what, FIXED_COST_ACTION, False, figs)
    return Verdict("fixed cost", "forward+backward is not dominated by fixed cost", "nothing to do", True, figs)
