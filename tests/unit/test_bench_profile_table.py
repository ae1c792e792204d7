"""bench/probes/profile_table.py: the per-step summary of a profile, checked against sums done by hand here."""

from __future__ import annotations

import pytest
import torch

from bench.probes.profile_table import Event, Span, category, events_of, format_table, idle_gaps, spans_of, summarize


def test_names_fall_into_their_categories():
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert category("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "gemm"
    assert category("_paged_decode_kernel") == "attention"
    assert category("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>>") == "attention"
    assert category("add_rms_norm_kernel") == "norm/elementwise"
    assert category("sample_kernel") == "sampling/log-probs"
    assert category("multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert category("Memcpy HtoD (Pageable -> Device)") == "copies"
    assert category("something_else") == "other"


def test_device_summary_counts_kernels_once_and_the_idle_share():
    events = [
        Event("sm90_xmma_gemm_x", count=40, device_us=6000.0, cpu_us=0.0, is_kernel=True),
        Event("_paged_decode_kernel", count=20, device_us=2000.0, cpu_us=0.0, is_kernel=True),
        Event("mystery", count=2, device_us=1000.0, cpu_us=0.0, is_kernel=True),
        # operator and runtime rows: host time, and device time already counted in the kernel rows above
        Event("aten::mm", count=40, device_us=6000.0, cpu_us=800.0, is_kernel=False),
        Event("cudaLaunchKernel", count=62, device_us=0.0, cpu_us=300.0, is_kernel=False),
        Event("cudaGraphLaunch", count=4, device_us=0.0, cpu_us=40.0, is_kernel=False),
        Event("cudaStreamSynchronize", count=2, device_us=0.0, cpu_us=900.0, is_kernel=False),
        Event("aten::item", count=6, device_us=0.0, cpu_us=50.0, is_kernel=False),
    ]
    s = summarize(events, steps=2, wall_s=0.012)
    assert s["clock"] == "device"
    assert s["busy_ms_per_step"] == pytest.approx((6000 + 2000 + 1000) / 1e3 / 2)
    assert s["ms_per_step"] == {"gemm": 3.0, "attention": 1.0, "other": 0.5}
    assert s["idle_share"] == pytest.approx(1 - 9000 / 12000)
    assert s["per_step"] == {"syncs": 4.0, "kernel_launches": 31.0, "graph_launches": 2.0}
    assert [r["name"] for r in s["largest"]] == ["sm90_xmma_gemm_x", "_paged_decode_kernel", "mystery"]
    table = format_table("decode step", s)
    assert "| gemm | 3.000 | 67% |" in table and "31 kernel launches" in table and "4 host syncs" in table


def test_a_cpu_profile_is_summed_by_operator():
    """No kernels on a CPU-only profile: the operators' own CPU time, without the runtime rows."""
    from torch.profiler import ProfilerActivity, profile

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (a @ b).relu_().sum().item()
    s = summarize(events_of(prof), steps=3, wall_s=1.0)
    assert s["clock"] == "cpu" and s["ms_per_step"]["gemm"] > 0
    assert s["per_step"]["syncs"] == 1.0  # one aten::item a step
    assert s["busy_ms_per_step"] == pytest.approx(sum(s["ms_per_step"].values()), rel=1e-3)


def test_idle_gaps_sum_the_spaces_between_kernels_and_name_the_largest():
    spans = [
        Span("gemm_a", 0.0, 100.0),
        Span("norm", 105.0, 110.0),  # 5 us after gemm_a: counted in all gaps, below the 20 us floor
        Span("side_stream", 106.0, 130.0),  # overlaps: the timeline ends at 130 now
        Span("gemm_b", 180.0, 200.0),  # 50 us after side_stream
        Span("gemm_a", 300.0, 310.0),  # 100 us after gemm_b
        Span("norm", 340.0, 350.0),  # 30 us
        Span("side_stream", 390.0, 400.0),  # 40 us after norm, again
    ]
    g = idle_gaps(spans, steps=2)
    assert g["span_ms"] == pytest.approx(400 / 1e3 / 2)
    assert g["gaps_ms"] == pytest.approx((5 + 50 + 100 + 30 + 40) / 1e3 / 2)
    assert g["gaps_over_20us_ms"] == pytest.approx((50 + 100 + 30 + 40) / 1e3 / 2)
    top = g["largest"][0]
    assert (top["after"], top["before"], top["count_per_step"]) == ("gemm_b", "gemm_a", 0.5)
    assert [(x["after"], x["before"]) for x in g["largest"]][1:] == [
        ("side_stream", "gemm_b"),
        ("norm", "side_stream"),
        ("gemm_a", "norm"),
    ]


def test_a_cpu_profile_has_no_device_spans():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert spans_of(prof) == []
    assert idle_gaps([], steps=1)["gaps_ms"] == 0.0
