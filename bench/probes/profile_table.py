"""Where a profiled region's time goes, by kind of work: the summary table issue 37 asks for before any change.

``summarize(prof, steps)`` reads a finished ``torch.profiler.profile`` and returns, per step:

- device time by category (GEMMs, attention, sampling and log-probs, norms and elementwise, the optimizer,
  copies, the rest), from the kernels' names; on a CPU-only profile, the operators' own CPU time instead;
- the GPU's idle share (the region's wall time less its summed kernel time: launch gaps, host work, syncs);
- kernel launches, CUDA-graph launches and host syncs (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``aten::item``), each a count per step;
- the largest kernels, so a category's total can be traced to its members.

CPU operators are those of the thread that ran the profiler (the engine's own thread is not seen from the main
thread); kernels and CUDA runtime calls are traced for the whole process. Categories are matched on lower-cased names, first match wins (``CATEGORIES``); what matches none lands in
"other" and is listed among the largest. ``format_table`` renders the markdown table for bench/LOG.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = tuple(
    (label, tuple(needles.split()))
    for label, needles in (
        ("attention", "flash fmha attention attn paged_decode flex sdpa _prefill varlen"),
        ("sampling/log-probs", ("sample sampling gumbel multinomial argmax topk top_k logsumexp log_softmax softmax "
                               "row_stats dense_grad cross_entropy")),
        ("optimizer", "adam multi_tensor foreach fused_adam"),
        ("gemm", "gemm cutlass xmma nvjet cublas matmul aten::mm aten::addmm aten::bmm aten::linear splitk sm90_ sm80_"),
        ("norm/elementwise", ("rms norm rope rotary silu gelu swiglu elementwise vectorized triton_poi triton_red "
                             "triton_per reduce aten::mul aten::add aten::sum aten::exp aten::where fused_")),
        ("copies", "memcpy memset copy cat index gather scatter fill"),
    )
)  # fmt: skip
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::item")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch",)


def category(name: str) -> str:
    """The category of a kernel or operator name (``CATEGORIES``; "other" when none matches)."""
    low = name.lower()
    for label, needles in CATEGORIES:
        if any(n in low for n in needles):
            return label
    return "other"


@dataclass(frozen=True)
class Event:
    """One row of ``key_averages()``: what the table needs of it."""

    name: str
    count: int
    device_us: float  # self time on the device (kernels); 0 for host-only rows
    cpu_us: float  # self time on the host
    is_kernel: bool  # a device kernel (or memcpy/memset) row, not an operator or runtime call


def events_of(prof: Any) -> list[Event]:
    """The profile's rows. Kernel rows are those with device time and no CPU time of their own (the profiler's
    device-side entries); operator rows keep their own CPU time."""
    out = []
    for e in prof.key_averages():
        dev = float(getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)
        cpu = float(getattr(e, "self_cpu_time_total", 0.0) or 0.0)
        out.append(Event(e.key, int(e.count), dev, cpu, is_kernel=dev > 0 and cpu == 0))
    return out


def summarize(events: Iterable[Event], steps: int, wall_s: float, top: int = 12) -> dict[str, Any]:
    """The per-step summary of ``events`` (``events_of(prof)``) over ``steps`` steps that took ``wall_s`` in all."""
    events = list(events)
    steps = max(steps, 1)
    kernels = [e for e in events if e.is_kernel]
    on_device = bool(kernels)
    rows = kernels if on_device else [e for e in events if not _is_runtime(e.name)]
    time_of = (lambda e: e.device_us) if on_device else (lambda e: e.cpu_us)
    by_cat: dict[str, float] = {}
    for e in rows:
        by_cat[category(e.name)] = by_cat.get(category(e.name), 0.0) + time_of(e)
    busy_us = sum(by_cat.values())
    wall_us = wall_s * 1e6
    count = {name: sum(e.count for e in events if e.name in names) for name, names in
             (("syncs", SYNCS), ("kernel_launches", LAUNCHES), ("graph_launches", GRAPH_LAUNCHES))}  # fmt: skip
    largest = sorted(rows, key=time_of, reverse=True)[:top]
    return {
        "clock": "device" if on_device else "cpu",
        "steps": steps,
        "wall_ms_per_step": wall_us / 1e3 / steps,
        "busy_ms_per_step": busy_us / 1e3 / steps,
        "idle_share": max(0.0, 1.0 - busy_us / wall_us) if wall_us > 0 else None,
        "ms_per_step": {k: round(v / 1e3 / steps, 4) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "per_step": {k: v / steps for k, v in count.items()},
        "largest": [
            {
                "name": e.name[:90],
                "category": category(e.name),
                "ms_per_step": round(time_of(e) / 1e3 / steps, 4),
                "calls_per_step": e.count / steps,
            }
            for e in largest
        ],
    }


@dataclass(frozen=True)
class Span:
    """One kernel on the device's timeline (microseconds)."""

    name: str
    start_us: float
    end_us: float


def spans_of(prof: Any) -> list[Span]:
    """The profile's device kernels (and memcpy/memset) in start order."""
    out = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CPU"):
            continue
        out.append(Span(e.name, float(e.time_range.start), float(e.time_range.end)))
    return sorted(out, key=lambda s: s.start_us)


def idle_gaps(spans: list[Span], steps: int, min_us: float = 20.0, top: int = 8) -> dict[str, Any]:
    """Where the device idles between kernels: all gaps summed, the gaps of at least ``min_us`` summed, and those
    grouped by the kernels on either side (largest total first), per step. The time before the first kernel and
    after the last is the wall time less ``span_ms``."""
    steps = max(steps, 1)
    total = big = 0.0
    groups: dict[tuple[str, str], list[float]] = {}
    end = spans[0].end_us if spans else 0.0
    prev = spans[0].name if spans else ""
    for s in spans[1:]:
        gap = s.start_us - end
        if gap > 0:
            total += gap
            if gap >= min_us:
                big += gap
                g = groups.setdefault((prev[:60], s.name[:60]), [0.0, 0])
                g[0] += gap
                g[1] += 1
        if s.end_us >= end:
            end, prev = s.end_us, s.name
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "span_ms": (end - spans[0].start_us) / 1e3 / steps if spans else 0.0,
        "gaps_ms": total / 1e3 / steps,
        f"gaps_over_{min_us:g}us_ms": big / 1e3 / steps,
        "largest": [
            {"after": a, "before": b, "ms_per_step": round(t / 1e3 / steps, 3), "count_per_step": n / steps}
            for (a, b), (t, n) in ranked
        ],
    }


def _is_runtime(name: str) -> bool:
    """CUDA runtime calls and the profiler's own rows: host time, but no work of the model."""
    return name.startswith(("cuda", "cu", "ProfilerStep", "[memory]")) or name in SYNCS


def format_table(title: str, summary: dict[str, Any]) -> str:
    """The markdown table of one summary (bench/LOG.md)."""
    clock = "GPU kernel" if summary["clock"] == "device" else "CPU operator"
    head = (
        f"**{title}** ({summary['steps']} steps; {clock} time per step; wall {summary['wall_ms_per_step']:.2f} ms, "
        f"busy {summary['busy_ms_per_step']:.2f} ms, idle share {summary['idle_share'] or 0:.0%})"
    )
    lines = [head, "", "| category | ms per step | share of busy |", "|---|---|---|"]
    busy = max(summary["busy_ms_per_step"], 1e-9)
    for cat, ms in summary["ms_per_step"].items():
        lines.append(f"| {cat} | {ms:.3f} | {ms / busy:.0%} |")
    per = summary["per_step"]
    counts = (
        f"Per step: {per['kernel_launches']:.0f} kernel launches, {per['graph_launches']:.0f} graph launches, "
        f"{per['syncs']:.0f} host syncs."
    )
    lines += ["", counts]
    return "\n".join(lines)
