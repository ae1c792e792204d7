"""The ipc backend's refusals against real embedded server processes on the CPU (no GPU needed).

A CPU server takes weights over gloo only: it says so in ``/server_info`` (no GPU UUID), refuses an ipc
``init_info`` with the flag to change, and the real sender asked for ``ipc`` stops at ``init`` instead of
failing mid-run. A server asked to receive over ipc on the CPU does not start.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.server.launcher import free_port
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.raw_http import raw
from tests.helpers.reference import server_greedy


@pytest.fixture(scope="module")
def cpu_server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "64")


def test_cpu_server_reports_gloo_only_and_refuses_an_ipc_init(cpu_server):
    status, info = raw(cpu_server.base_url, "GET", "/server_info?config_format=json")
    assert status == 200
    assert info["asyncgrpo"]["weight_transfer_backends"] == ["gloo"] and info["asyncgrpo"]["gpu_uuid"] is None
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
    status, body = raw(
        cpu_server.base_url, "POST", "/init_weight_transfer_engine", json={"init_info": {"packed": True}}
    )
    assert status == 400
    assert "ipc init" in body["error"]["message"] and '{"backend": "ipc"}' in body["error"]["message"]


def test_the_sender_asked_for_ipc_stops_at_init(cpu_server):
    sender = WeightSender(timeout_s=60)
    with pytest.raises(ValueError, match=r"weight_sync_backend='ipc' but the server accepts \['gloo'\]"):
        sender.init(AsyncServerClient(cpu_server.base_url), backend="ipc", device="cpu")
    sender.close()
    sender.init(AsyncServerClient(cpu_server.base_url), backend="auto", device="cpu")  # auto: gloo, as before
    assert sender.backend == "gloo"
    sender.close()


def test_an_ipc_server_on_the_cpu_does_not_start(tiny_llama_dir):
    cmd = [sys.executable, "-m", "asyncgrpo.server.main", str(tiny_llama_dir), "--device", "cpu",
           "--port", str(free_port()), "--weight-transfer-config", '{"backend": "ipc"}']  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "the ipc weight-transfer backend needs the engine on CUDA" in done.stdout + done.stderr


def test_a_weight_round_step_folds_pause_start_finish_resume_and_closes_a_failed_round(cpu_server):
    """``POST /weight_round_step`` (ours, server/engine/round_step.py) on a real server process: ``begin`` pauses
    (keep) and opens the round, ``end`` closes it with the version and resumes; a failing step answers vLLM's
    500 after closing the round and resuming, so the server generates and takes a new round at once."""
    url = cpu_server.base_url
    status, info = raw(url, "GET", "/server_info?config_format=json")
    assert status == 200 and info["asyncgrpo"]["weight_round_step"] is True
    assert raw(url, "POST", "/weight_round_step", json={"begin": "yes"})[0] == 400
    status, body = raw(url, "POST", "/weight_round_step", json={"begin": True, "end": False})
    assert status == 200 and raw(url, "GET", "/is_paused")[1] == {"is_paused": True}
    assert raw(url, "POST", "/start_weight_update")[0] == 500  # the round is open: a second start is refused
    status, body = raw(url, "POST", "/weight_round_step", json={"end": True, "weight_version": "step-1"})
    assert status == 200 and body["weight_version"] == "step-1"
    assert raw(url, "GET", "/is_paused")[1] == {"is_paused": False}
    assert raw(url, "GET", "/weight_info")[1] == {"weight_version": "step-1"}
    bad = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}
    status, body = raw(url, "POST", "/weight_round_step", json={"begin": True, "end": True, "update_info": bad,
                                                                 "weight_version": "never"})  # fmt: skip
    assert status == 500 and "not initialized" in body["error"]["message"]  # no group: vLLM's 500
    assert raw(url, "GET", "/is_paused")[1] == {"is_paused": False}
    assert raw(url, "GET", "/weight_info")[1] == {"weight_version": "step-1"}
    assert raw(url, "POST", "/start_weight_update")[0] == 200  # the failed round was closed
    assert raw(url, "POST", "/finish_weight_update", json={})[0] == 200
    result, version = server_greedy(url)  # generating again, with the last round's version
    assert version == "step-1" and len(result.token_ids) > 0
