"""The diagnosis tables of docs/metrics.md ("The run doctor"), applied to the last steps of a run (X2).

The tables: the rollout queue (which side is the bottleneck), concurrency (which limit holds generation
back), saturation (``frac_reward_zero_std`` / ``reward_dropped`` / ``reward`` read together), duplicates,
the sampler mismatch (how much the sampler correction masks or truncates), MoE routing (is a
sampler/trainer log-prob gap the routers' doing), and in ``report/startup.py`` warm-up and fixed cost (where
a short run's time goes).
The tables state the rows in words ("high", "nearly empty", "climbing"); the constants below turn each
word into a figure, and every verdict carries the figures it rests on so a reader can disagree with them.
"""

from __future__ import annotations

from asyncgrpo.report.runlog import RunLog
from asyncgrpo.report.startup import fixed_cost_verdict, warmup_verdict
from asyncgrpo.report.verdict import Verdict
from asyncgrpo.report.verdict import g3 as _g
from asyncgrpo.report.verdict import mean as _mean
from asyncgrpo.report.verdict import pct as _pct

# ---- what the table words mean here ----------------------------------------------------------------------------------
WAIT_HIGH = 0.2  # the trainer idles on an empty queue for more than a fifth of a step (median window)
WAIT_LOW = 0.05  # ... or less than 5 %: "near zero"
# rollout/backpressure_s is the wait before each group start; compared with the step time it says how much of a
# step generation loses each time max_staleness holds it back.
BLOCKED_HIGH = 0.2
BLOCKED_LOW = 0.05
QUEUE_EMPTY_STEPS = 0.5  # "nearly empty": less than half a step of samples waiting
QUEUE_FULL_FRAC = 0.5  # "about max_staleness steps": at least half of max(max_staleness, 1) steps queued
CAP_BELOW = 0.9  # the live cap sits below 90 % of max_concurrent_rollouts: the server's load limits it
AT_CAP = 0.9  # concurrency within 10 % of max_concurrent_rollouts: "reaches" it
KV_LOW = 0.6  # the worker raises its cap only below 60 % KV use (G5 in docs/spec.md), so below is "low"
ZERO_STD_LOW = 0.25
ZERO_STD_HIGH = 0.5
CLIMB = 0.1  # a fraction moved by more than 0.1 across the window (least-squares fit): climbing/falling
REWARD_MOVE = 0.05  # reward moved by more than 5 % of the reward range across the window
TOP, BOTTOM = 0.75, 0.25  # reward_dropped in the top / bottom quarter of the reward range
DUP_HEALTHY = 0.05
DUP_JUMP = 0.8  # duplicates above 80 % of (G-1)/G: nearly every group is copies of one rollout
DUP_CLIMB = 0.05
CLIPPED_HIGH = 0.2
MASKED_HIGH = 0.1  # the sampler correction removes more than a tenth of the trained tokens (window mean)
TRUNCATED_HIGH = 0.2  # ... or clamps the weight of more than a fifth
# MoE routing: a mean |sampler - trainer log-prob| above 0.02 nats is well past bf16 rounding on a dense model
# (~1e-3); a router whose top-k set differs from the sampler's for more than 2 % of tokens in a layer is enough
# for that gap (each flip changes a token's hidden state in every later layer).
LOGP_GAP_HIGH = 0.02
ROUTING_HIGH = 0.02


def _change(steps: list[float], values: list[float]) -> float:
    """Least-squares change of ``values`` from the first to the last step (0 with fewer than 3 points)."""
    if len(values) < 3 or steps[-1] == steps[0]:
        return 0.0
    ms, mv = _mean(steps), _mean(values)
    var = sum((s - ms) ** 2 for s in steps)
    slope = sum((s - ms) * (v - mv) for s, v in zip(steps, values)) / var
    return slope * (steps[-1] - steps[0])


# ---- rollout queue ---------------------------------------------------------------------------------------------------
def queue_verdict(run: RunLog, last: int) -> Verdict | None:
    median_wait = _share(run, "perf/rollout_wait_s", last)
    if median_wait is None:
        return None
    # A generation-bound run whose steps alternate (rollouts in flight finish together: one step finds them ready,
    # the next waits) has a median wait near zero; the mean of the capped per-window shares still shows the idling,
    # and one long wait (a server hiccup) moves it by at most 1/n.
    mean_wait = _mean_share(run, "perf/rollout_wait_s", last) or 0.0
    wait = max(median_wait, mean_wait)
    queue = _mean(run.series("rollout/queue_size", last)[1])
    per_step = _mean(run.series("batch/samples_per_step", last)[1])
    queue_steps = queue / per_step if queue is not None and per_step else None
    blocked = _share(run, "rollout/backpressure_s", last)
    n = len(run.recent(last))
    figs = {
        "perf/rollout_wait_s": f"{_pct(median_wait)} of a step (median of the last {n} windows; mean {_pct(mean_wait)})",
        "rollout/queue_size": "n/a" if queue_steps is None else f"{_g(queue)} samples = {queue_steps:.2f} steps",
        "rollout/backpressure_s": "n/a" if blocked is None else f"{_pct(blocked)} of a step per group start",
        "max_staleness": str(run.settings.max_staleness),
    }
    blocked = blocked or 0.0
    full = max(run.settings.max_staleness, 1) * QUEUE_FULL_FRAC
    if wait >= WAIT_HIGH and blocked >= BLOCKED_HIGH:
        return Verdict(
            "queue",
            f"the trainer waited {_pct(wait)} and generation was blocked too: max_staleness itself is too tight",
            "raise max_staleness",
            False,
            figs,
        )
    if wait >= WAIT_HIGH and (queue_steps is None or queue_steps < QUEUE_EMPTY_STEPS):
        return Verdict(
            "queue",
            f"the trainer waited {_pct(wait)} of a step (median, last {n} windows), the queue is nearly "
            "empty: generation-bound",
            "add generation capacity: another server in vllm_server_base_url, or a larger server "
            "(--gpu-memory-utilization, --max-num-seqs); shorter completions (max_completion_length) or fewer "
            "(num_generations) make each step cheaper to generate. rollout/generated_tokens_per_s and the "
            "concurrency table say which limit holds generation back",
            False,
            figs,
        )
    if blocked >= BLOCKED_HIGH and (queue_steps is None or queue_steps >= full):
        return Verdict(
            "queue",
            "the queue holds about max_staleness steps of samples and generation waits: trainer-bound",
            "nothing to change: expected when inference is faster than training. To train faster: "
            "gradient_checkpointing=False if memory allows, compile_decoder_layers=True, more GPUs (fsdp)",
            True,
            figs,
        )
    if wait < WAIT_LOW and blocked < BLOCKED_LOW:
        return Verdict("queue", "neither side waits: balanced", "nothing to do", True, figs)
    return Verdict(
        "queue",
        "both sides wait a little: no clear bottleneck",
        "nothing to change yet; if perf/rollout_wait_s grows, add generation capacity (vllm_server_base_url), if "
        "rollout/backpressure_s grows, raise max_staleness",
        True,
        figs,
    )


def _share(run: RunLog, name: str, last: int) -> float | None:
    """Median over the windows of ``name / perf/step_s``: one slow step (a checkpoint, a long first sync) does
    not hide what the other steps show."""
    shares = sorted(r[name] / r["perf/step_s"] for r in run.recent(last) if name in r and r.get("perf/step_s", 0) > 0)
    if not shares:
        return None
    mid = len(shares) // 2
    return shares[mid] if len(shares) % 2 else (shares[mid - 1] + shares[mid]) / 2


def _mean_share(run: RunLog, name: str, last: int) -> float | None:
    """Mean over the windows of ``name / perf/step_s``, each capped at 1: how much of its time the trainer spent on
    ``name`` where it alternates between steps (the median says 0 when fewer than half the steps wait)."""
    shares = [
        min(r[name] / r["perf/step_s"], 1.0) for r in run.recent(last) if name in r and r.get("perf/step_s", 0) > 0
    ]
    return sum(shares) / len(shares) if shares else None


def _wait_share(run: RunLog, last: int) -> float:
    """The trainer's wait for samples as a share of a step: the larger of the median and the capped mean."""
    return max(_share(run, "perf/rollout_wait_s", last) or 0.0, _mean_share(run, "perf/rollout_wait_s", last) or 0.0)


# ---- concurrency -----------------------------------------------------------------------------------------------------
def concurrency_verdict(run: RunLog, last: int) -> Verdict | None:
    conc = _mean(run.series("rollout/concurrency", last)[1])
    if conc is None:
        return None
    limit = run.settings.max_concurrent_rollouts
    cap = _mean(run.series("rollout/concurrency_cap", last)[1])
    kv = _mean(run.series("rollout/vllm_kv_cache_usage_frac", last)[1])
    wait = _wait_share(run, last)
    blocked = _share(run, "rollout/backpressure_s", last) or 0.0
    figs = {
        "rollout/concurrency": _g(conc),
        "rollout/concurrency_cap": "n/a" if cap is None else _g(cap),
        "max_concurrent_rollouts": str(limit),
        "rollout/vllm_kv_cache_usage_frac": "n/a" if kv is None else _pct(kv),
        "perf/rollout_wait_s": f"{_pct(wait)} of a step",
    }
    if conc >= AT_CAP * limit and (kv is None or kv < KV_LOW) and wait >= WAIT_HIGH:
        return Verdict(
            "concurrency",
            "rollouts reach max_concurrent_rollouts while the KV cache has room and the "
            "trainer waits: the user's cap is the limit",
            "raise max_concurrent_rollouts if the environment and tools allow it",
            False,
            figs,
        )
    if cap is not None and cap < CAP_BELOW * limit and conc >= AT_CAP * cap:
        return Verdict(
            "concurrency",
            "rollouts fill the live cap, which sits below max_concurrent_rollouts: the server's load limits generation",
            "give the server more KV cache (--gpu-memory-utilization or --kv-cache-tokens, a shorter "
            "--max-model-len) or add a server to vllm_server_base_url",
            wait < WAIT_HIGH,
            figs,
        )
    if blocked >= BLOCKED_HIGH:
        figs["rollout/backpressure_s"] = f"{_pct(blocked)} of a step per group start"
        if wait >= WAIT_HIGH:  # the queue table's "max_staleness itself is too tight": say the same thing here
            return Verdict(
                "concurrency",
                "generation waits on max_staleness while the trainer waits for samples: the staleness limit is "
                "too tight",
                "raise max_staleness",
                False,
                figs,
            )
        return Verdict(
            "concurrency",
            "generation waits on max_staleness: the staleness limit holds it",
            "nothing to change: expected when inference is faster than training",
            True,
            figs,
        )
    return Verdict(
        "concurrency", "no limit binds: fewer rollouts are ready than any cap allows", "nothing to do", True, figs
    )


# ---- saturation ------------------------------------------------------------------------------------------------------
def _reward_range(run: RunLog) -> tuple[float, float]:
    if run.settings.reward_range is not None:
        return run.settings.reward_range
    seen = [v for name in ("reward", "reward_kept", "reward_dropped") for v in run.series(name)[1]]
    return min([0.0, *seen]), max([1.0, *seen])


def saturation_verdict(run: RunLog, last: int) -> Verdict | None:
    zs_steps, zs = run.series("frac_reward_zero_std", last)
    r_steps, reward = run.series("reward", last)
    if not zs or not reward:
        return None
    lo, hi = _reward_range(run)
    span = hi - lo
    d_steps, dropped = run.series("reward_dropped", last)
    zs_now, zs_move = zs[-1] if len(zs) < 3 else _mean(zs[-3:]), _change(zs_steps, zs)
    r_move = _change(r_steps, reward) / span
    d_pos = None if not dropped else (_mean(dropped[-3:]) - lo) / span
    d_move = _change(d_steps, dropped) / span if dropped else 0.0
    figs = {
        "frac_reward_zero_std": f"{_g(zs_now)} (change {zs_move:+.2f})",
        "reward_dropped": "n/a"
        if d_pos is None
        else f"{_g(_mean(dropped[-3:]))} ({_pct(d_pos)} of range, change {d_move * span:+.2g})",
        "reward": f"{_g(_mean(reward[-3:]))} (change {r_move * span:+.2g})",
        "reward range": f"[{_g(lo)}, {_g(hi)}]",
    }
    if zs_move > CLIMB and d_move < -REWARD_MOVE and r_move < -REWARD_MOVE:
        return Verdict(
            "saturation",
            "regression: groups that used to pass now fail together",
            "lower learning_rate, or resume from an earlier checkpoint (resume_from_checkpoint); "
            "completions/duplicate_frac and entropy show whether the policy collapsed",
            False,
            figs,
        )
    if zs_move > CLIMB and d_pos is not None and d_pos >= TOP and r_move > REWARD_MOVE:
        return Verdict(
            "saturation",
            "saturating at the top: the prompts became too easy for the policy (a "
            "successful run usually ends like this)",
            "stop the run (max_steps) or train on harder prompts (the dataset)",
            True,
            figs,
        )
    if zs_now >= ZERO_STD_HIGH and d_pos is not None and d_pos <= BOTTOM and abs(r_move) <= REWARD_MOVE:
        clipped = _mean(run.series("completions/clipped_ratio", last)[1])
        if clipped is not None:
            figs["completions/clipped_ratio"] = _g(clipped)
        first = (
            "completions/clipped_ratio is high: completions are cut before the answer and score 0; raise "
            "max_completion_length"
            if clipped is not None and clipped >= CLIPPED_HIGH
            else "check completions/clipped_ratio first (cut completions score 0; max_completion_length)"
        )
        return Verdict(
            "saturation",
            "stuck at the bottom: the prompts are too hard or the reward function gives no credit",
            f"{first}, then read a few completions (log_completions=True) to see whether reward_funcs parse them",
            False,
            figs,
        )
    if zs_now >= ZERO_STD_HIGH and d_pos is not None and BOTTOM < d_pos < TOP:
        return Verdict(
            "saturation",
            "mixed: some prompts are too easy and others too hard (or groups sit on one partial score)",
            "read the rollouts (log_completions=True); a larger num_generations splits more groups",
            False,
            figs,
        )
    if zs_now < ZERO_STD_LOW:
        return Verdict("saturation", "healthy: most groups produce a gradient", "nothing to do", True, figs)
    return Verdict(
        "saturation",
        "a sizeable share of groups (25-50 %) gives no signal, without a clear trend",
        "nothing to change yet; a larger num_generations or temperature splits more groups",
        True,
        figs,
    )


# ---- duplicates ------------------------------------------------------------------------------------------------------
def duplicate_verdict(run: RunLog, last: int) -> Verdict | None:
    steps, dup = run.series("completions/duplicate_frac", last)
    if not dup:
        return None
    g = run.settings.num_generations
    ceiling = (g - 1) / g
    now = _mean(dup[-3:])
    move = _change(steps, dup)
    e_steps, ent = run.series("entropy", last)
    e_move = _change(e_steps, ent)
    figs = {
        "completions/duplicate_frac": f"{_g(now)} (change {move:+.2f})",
        "(num_generations - 1) / num_generations": _g(ceiling),
        "entropy": "n/a" if not ent else f"{_g(_mean(ent[-3:]))} (change {e_move:+.2g})",
    }
    if now >= DUP_JUMP * ceiling:
        return Verdict(
            "duplicates",
            "sampling is no longer random: every group returns copies of one rollout",
            "raise temperature, and give each data-parallel server its own --seed",
            False,
            figs,
        )
    if move > DUP_CLIMB and e_move < 0:
        return Verdict(
            "duplicates",
            "collapse: the policy converges to one answer per prompt",
            "raise temperature or lower learning_rate, or resume from the last good checkpoint "
            "(resume_from_checkpoint)",
            False,
            figs,
        )
    if now <= DUP_HEALTHY:
        return Verdict(
            "duplicates", "healthy: a group's rollouts are sampled independently", "nothing to do", True, figs
        )
    return Verdict(
        "duplicates",
        "a steady share of duplicates: usual for tasks with short completions",
        "nothing to do unless it climbs (then raise temperature)",
        True,
        figs,
    )


# ---- sampler mismatch ------------------------------------------------------------------------------------------------
MISMATCH_CAUSES = (
    "likely causes: stale samples (lower max_staleness or learning_rate when sample/staleness_mean is high), "
    "numerics (a bf16 server against an fp32 trainer, or other kernels: compare the server's dtype with bf16), "
    "sampling the server did not apply as configured (temperature, top_k, top_p), or weights that did not reach "
    "the server (perf/weight_sync_s); widen vllm_importance_sampling_clip_min / clip_max only once the cause is known"
)


def sampler_verdict(run: RunLog, last: int) -> Verdict | None:
    """How much of the batch the sampler correction removes (``sampling/masked_mean``) or clamps."""
    _, masked = run.series("sampling/masked_mean", last)
    if not masked:
        return None
    _, trunc = run.series("sampling/truncated_mean", last)
    _, stale = run.series("sample/staleness_mean", last)
    _, diff = run.series("sampling/sampling_logp_difference/mean", last)
    m, t = _mean(masked), _mean(trunc)
    figs = {"sampling/masked_mean": _pct(m), "sampling/truncated_mean": "n/a" if t is None else _pct(t),
            "sample/staleness_mean": "n/a" if not stale else _g(_mean(stale)),
            "sampling/sampling_logp_difference/mean": "n/a" if not diff else _g(_mean(diff))}  # fmt: skip
    if m > MASKED_HIGH:
        what = f"the sampler correction removes {_pct(m)} of the trained tokens: the sampler and the trainer disagree"
        return Verdict("sampler mismatch", what, MISMATCH_CAUSES, False, figs)
    if t is not None and t > TRUNCATED_HIGH:
        what = f"the sampler correction clamps the weight of {_pct(t)} of the trained tokens"
        return Verdict("sampler mismatch", what, MISMATCH_CAUSES, False, figs)
    return Verdict("sampler mismatch", "healthy: the sampler and the trainer agree on nearly every token",
                   "nothing to do", True, figs)  # fmt: skip


# ---- MoE routing -----------------------------------------------------------------------------------------------------
def routing_verdict(run: RunLog, last: int) -> Verdict | None:
    """On an MoE model: is the sampler/trainer log-prob gap the routers' doing (routing replay fixes that)?"""
    moe = run.settings.mixture_of_experts or any(run.has(n) for n in ("aux_loss", "moe/router_disagreement/mean"))
    gap = _mean(run.series("sampling/sampling_logp_difference/mean", last)[1][-3:])
    if not moe or gap is None:
        return None
    disagree = _mean(run.series("moe/router_disagreement/mean", last)[1][-3:])
    worst = _mean(run.series("moe/router_disagreement/max", last)[1][-3:])
    replay = run.settings.router_replay
    figs = {
        "sampling/sampling_logp_difference/mean": _g(gap),
        "moe/router_disagreement/mean": "n/a" if disagree is None else _pct(disagree),
        "moe/router_disagreement/max": "n/a" if worst is None else _pct(worst),
        "router_replay": str(replay),
    }
    if gap <= LOGP_GAP_HIGH:
        return Verdict("routing", "sampler and trainer log-probs agree", "nothing to do", True, figs)
    if replay:
        return Verdict(
            "routing",
            "the log-prob gap is high although routing is replayed: the routers are not its cause",
            "compare the server's and the trainer's dtype (a bf16 server for an fp32 trainer) and sample/staleness_mean",
            False,
            figs,
        )
    if disagree is not None and (worst or disagree) <= ROUTING_HIGH:
        return Verdict(
            "routing",
            "the log-prob gap is high but the routers mostly agree with the sampler's: routing is not its cause",
            "compare the server's and the trainer's dtype and sample/staleness_mean",
            False,
            figs,
        )
    return Verdict(
        "routing",
        "routing mismatch: on this mixture-of-experts model the trainer's routers choose other experts than the "
        "sampler's" + ("" if disagree is not None else " (the usual cause of a high log-prob gap on MoE models)"),
        "set router_replay=True and start the server with --enable-return-routed-experts"
        + ("" if disagree is not None else " (vllm_return_routed_experts=True measures the mismatch first)"),
        False,
        figs,
    )


def diagnose(run: RunLog, last: int = 50) -> list[Verdict]:
    """Every table that the run's metrics allow, over the windows of the last ``last`` steps."""
    checks = (
        queue_verdict,
        concurrency_verdict,
        saturation_verdict,
        duplicate_verdict,
        sampler_verdict,
        routing_verdict,
        warmup_verdict,
        fixed_cost_verdict,
    )
    return [v for v in (check(run, last) for check in checks) if v is not None]
