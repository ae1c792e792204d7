"""The Prometheus text parser on hand-written expositions."""

from __future__ import annotations

import math

import pytest

from asyncgrpo.client.metrics_text import parse_prometheus_text, vllm_metrics

EXPOSITION = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7
vllm:num_requests_waiting{engine="1",model_name="m"} 0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0 1712345678000
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
vllm:other{engine="0",model_name="other-model"} 100
process_cpu_seconds_total 12.5
odd_metric{path="a \\"quoted\\" \\\\ back, {brace}",le="+Inf"} +Inf
nan_metric NaN
"""


def test_parse_samples_labels_and_special_values():
    samples = parse_prometheus_text(EXPOSITION)
    by_name = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    assert len(samples) == 12
    odd = by_name["odd_metric"][0]
    assert odd.labels == {"path": 'a "quoted" \\ back, {brace}', "le": "+Inf"}
    assert odd.value == math.inf
    assert math.isnan(by_name["nan_metric"][0].value)
    # the trailing timestamp is not the value
    assert by_name["vllm:num_preemptions_total"][0].value == 4.0
    assert by_name["process_cpu_seconds_total"][0].labels == {}
    assert by_name["vllm:num_requests_running"][1].labels == {"engine": "1", "model_name": "m"}


def test_vllm_metrics_sums_engines_and_averages_kv_usage():
    m = vllm_metrics(EXPOSITION)
    assert m["vllm:num_requests_running"] == 5.0  # 3 + 2
    assert m["vllm:num_requests_waiting"] == 7.0  # 7 + 0
    assert m["vllm:kv_cache_usage_perc"] == 0.75  # the fullest engine (max of 0.25, 0.75)
    assert m["vllm:num_preemptions_total"] == 4.0
    assert "process_cpu_seconds_total" not in m
    assert m["vllm:other"] == 100.0


def test_vllm_metrics_filters_by_model_name():
    m = vllm_metrics(EXPOSITION, model_name="m")
    assert "vllm:other" not in m
    assert m["vllm:num_requests_running"] == 5.0


@pytest.mark.parametrize(
    "bad",
    ['vllm:x{engine="0"}', 'vllm:x{engine="0" 1', "vllm:x{engine=0} 1", "vllm:x notanumber"],
)
def test_malformed_lines_raise_naming_the_line(bad):
    with pytest.raises(ValueError, match="vllm:x"):
        parse_prometheus_text(bad)


def test_error_names_the_bad_line_of_a_longer_exposition():
    text = 'vllm:a{engine="0"} 1\nvllm:b{engine=0} 2\nvllm:c 3\n'
    with pytest.raises(ValueError, match=r"line 'vllm:b\{engine=0\} 2'"):
        parse_prometheus_text(text)
