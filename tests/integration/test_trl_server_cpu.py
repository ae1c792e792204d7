"""Issue 43 against a real ``asyncgrpo serve`` process.

The timeouts: once a run has checkpointed, a fault-injecting proxy in front of the server
(``tests/helpers/stall_proxy.py``) stops answering one kind of request. A generation request left unanswered stops
the run within ``request_timeout``, naming it; a weight transfer left hanging stops it within
``weight_sync_timeout``, naming it. The checkpoint and the metrics written before stay whole.

``queue_maxsize`` bounds the samples waiting for the trainer (a run without the bound queues far more), and
docs/usage.md's TRL 1.16 script runs after changing only its import.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.errors import WeightSyncTimeoutError
from asyncgrpo.rollout.worker import RolloutWorkerError
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from tests.helpers import stall_proxy

pytestmark = [pytest.mark.slow, pytest.mark.long]  # five runs against a real server (~2.5 min): `make test-long`
USAGE = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
SLACK_S = 8.0  # 2 shared cores: the worker's health poll, the trainer's step in progress, process scheduling


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384")


@pytest.fixture
def proxy(request, server, tmp_path):
    """``proxy(paths)`` -> (base URL, flag file, hold log); the proxy process ends with the test."""
    procs = []

    def start(paths: list[str]) -> tuple[str, Path, Path]:
        flag, log = tmp_path / "stall", tmp_path / "held.log"
        proc, url = stall_proxy.start(server.base_url, flag, log, paths)
        procs.append(proc)
        return url, flag, log

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


def _run(tmp_path: Path, url: str, tiny_llama_dir: Path, flag: Path, **overrides):
    """Train until it fails, creating ``flag`` once checkpoint-1 is written; returns (exception, time it failed)."""
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=40, num_generations=4, max_completion_length=12, token_budget=384,
        vllm_server_base_url=url, report_to=[], save_strategy="steps", save_steps=1, learning_rate=1e-3,
        gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=60, seed=0, **overrides,
    )  # fmt: skip
    dataset = reasoning_gym_dataset("chain_sum", size=64, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset)
    done = threading.Event()

    def arm() -> None:
        while not done.is_set() and not (tmp_path / "out" / "checkpoint-1" / "rollout_state.json").exists():
            time.sleep(0.05)
        flag.touch()

    threading.Thread(target=arm, daemon=True).start()
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        return exc, time.time()
    finally:
        done.set()
    raise AssertionError("the run was expected to fail once the proxy stalled")


def _held(log: Path, path: str) -> list[float]:
    return [float(t) for t, p in (line.split() for line in log.read_text().splitlines()) if p == path]


def _intact(tmp_path: Path) -> None:
    """Every checkpoint loads and records where generation resumes; every metrics line is whole JSON."""
    out = tmp_path / "out"
    ckpts = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert ckpts and ckpts[0].name == "checkpoint-1"
    for ckpt in ckpts:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        state = json.loads((ckpt / "rollout_state.json").read_text())
        assert state["step"] == int(ckpt.name.split("-")[1]) and state["first_untrained_prompt"] >= 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= len(ckpts)
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)


def test_an_unanswered_generation_request_stops_the_run_within_request_timeout(
    tmp_path, proxy, tiny_llama_dir, record_property
):
    url, flag, log = proxy(["/v1/completions", "/inference/v1/generate"])
    # sync_rollouts: the trainer waits on the worker while it generates, so the failure is seen the moment it
    # happens (with samples queued ahead the trainer would first train them, as it should).
    exc, failed_at = _run(tmp_path, url, tiny_llama_dir, flag, request_timeout=4, sync_rollouts=True, max_staleness=1)
    assert isinstance(exc, RolloutWorkerError), repr(exc)
    assert "request_timeout=4" in str(exc) and "ServerTimeoutError" in str(exc)
    held = _held(log, "/v1/completions") + _held(log, "/inference/v1/generate")
    assert held, "no generation request was held"
    record_property("failed_after_s", round(failed_at - min(held), 3))  # --junitxml keeps the measurement
    assert 4.0 <= failed_at - min(held) < 4.0 + SLACK_S, failed_at - min(held)
    _intact(tmp_path)


def test_a_hanging_weight_transfer_stops_the_run_within_weight_sync_timeout(
    tmp_path, proxy, tiny_llama_dir, server, record_property
):
    url, flag, log = proxy(["/update_weights"])  # the server never joins the broadcast: the transfer stalls
    exc, failed_at = _run(tmp_path, url, tiny_llama_dir, flag, weight_sync_timeout=4)
    assert isinstance(exc, WeightSyncTimeoutError), repr(exc)
    # Either the broadcast times out (gloo's send) or, when the tiny model's tensors fit in the socket buffers,
    # the server's answer to /update_weights never comes: both are this round's transfer stalling.
    assert "weight_sync_timeout=4s" in str(exc)
    assert "POST /update_weights" in str(exc) or "Timed out waiting 4000ms for send" in str(exc)
    held = _held(log, "/update_weights")
    assert len(held) == 1
    record_property("failed_after_s", round(failed_at - held[0], 3))
    assert 4.0 <= failed_at - held[0] < 4.0 + SLACK_S, failed_at - held[0]
    _intact(tmp_path)


def _replace_once(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"docs/usage.md's TRL 1.16 script no longer contains {old!r} exactly once"
    return code.replace(old, new)


def test_the_trl_1_16_script_of_usage_md_runs_after_changing_its_import(tmp_path, server, tiny_llama_dir):
    section = USAGE.split("\n## Coming from TRL 1.16\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    # The one change a TRL 1.16 user makes:
    code = _replace_once(code, "from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer",
                         "from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer")  # fmt: skip
    # The test's own: this test's server and offline tiny model, a scratch folder, two steps instead of twenty.
    code = _replace_once(code, '"http://localhost:8000"', repr(server.base_url))
    code = _replace_once(code, '"HuggingFaceTB/SmolLM2-135M-Instruct"', repr(str(tiny_llama_dir)))
    code = _replace_once(code, 'output_dir="trl-async-out"', f"output_dir={str(tmp_path / 'out')!r}")
    code = _replace_once(code, "max_steps=20", "max_steps=2")
    script = tmp_path / "trl_script.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, capture_output=True, text=True,
                          timeout=420)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    line = ("TRL 1.16 names in the config: max_inflight_tasks=32 -> max_concurrent_rollouts=32; "
            "heartbeat_stale_after_s=120.0 -> rollout_worker_timeout=120.0")  # fmt: skip
    assert done.stderr.count(line) == 1 and line in USAGE.replace("\n", " ")  # once, and as the page quotes it
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]


class SlowTrainer(AsyncGRPOTrainer):
    """Training slower than generation, so that samples pile up in the queue unless something bounds it."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        time.sleep(1.5)
        return super().training_step(model, inputs, num_items_in_batch)


def test_queue_maxsize_bounds_the_samples_waiting_for_the_trainer(tmp_path, server, tiny_llama_dir, record_property):
    dataset = reasoning_gym_dataset("chain_sum", size=64, seed=0, system_prompt=None)
    peaks = {}
    for bound in (0, 4):  # 0: no bound, only max_staleness's token allowance paces generation
        out = tmp_path / f"q{bound}"
        args = AsyncGRPOConfig(
            output_dir=str(out), max_steps=4, num_generations=4, max_completion_length=12, token_budget=384,
            vllm_server_base_url=server.base_url, report_to=[], save_strategy="no", learning_rate=1e-3,
            gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=60, seed=0,
            queue_maxsize=bound,
        )  # fmt: skip
        SlowTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset).train()
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        peaks[bound] = max(r["rollout/queue_size"] for r in rows if "rollout/queue_size" in r)
    # Samples waiting when a step starts pulling: never more than the bound (a group of 4 fits it exactly),
    # while without it generation runs ahead by max_staleness steps' worth of tokens.
    record_property("queue_size_peaks", json.dumps(peaks))
    assert peaks[4] <= 4 < peaks[0], peaks
