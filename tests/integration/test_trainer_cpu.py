"""End-to-end async GRPO on CPU: real server process, real worker process, real trainer (issue 3 acceptance).

Rewards here are module-level functions of the token ids (a tiny random model cannot solve math), so groups
have reward variance and are trained.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import os
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.metrics import is_documented_metric
from asyncgrpo.rollout.worker import RolloutWorkerError
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

pytestmark = pytest.mark.slow

TRAINER_OWN_KEYS = {"loss", "grad_norm", "learning_rate", "epoch", "step", "time"}


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def exploding_reward(completions, **kwargs):
    raise ValueError("the judge is offline")


class RecordingLoop(AsyncRolloutLoop):
    """Writes each prompt index it is asked about to the file named by $ASYNCGRPO_TEST_PROMPT_LOG."""

    def filter_prompt(self, row_index, row, epoch):
        with open(os.environ["ASYNCGRPO_TEST_PROMPT_LOG"], "a") as fh:
            fh.write(f"{epoch * len(self.dataset) + row_index}\n")
        return True


class RecompileAtStepTwo(TrainerCallback):
    """A real torch.compile in the trainer's process: compiled during step 1 (warm-up), recompiled at step 2 (another
    input size); user callbacks run before the trainer's own, so each call lands in that step's window."""

    def __init__(self) -> None:
        self.fn = torch.compile(lambda x: torch.cos(x) + 1.0, backend="eager")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (1, 2):
            self.fn(torch.ones(3 if state.global_step == 1 else 6))


class HeapWatch(TrainerCallback):
    """Whether the process's heap is frozen at each step's end (trainer/heap.py)."""

    def __init__(self) -> None:
        self.frozen: list[bool] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.frozen.append(gc.get_freeze_count() > 0)


class RecordingTrainer(AsyncGRPOTrainer):
    loop_cls = RecordingLoop


class SlowTrainer(AsyncGRPOTrainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        time.sleep(1.0)
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.fixture(scope="module")
def servers(serve, tiny_llama_dir):
    """The module's server and the top-k test's --return-sampling-mask one, started side by side."""
    flags = ("--max-model-len", "256", "--kv-cache-tokens", "16384")
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda extra: serve(tiny_llama_dir, *flags, *extra), [(), ("--return-sampling-mask",)]))


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def dataset():
    return reasoning_gym_dataset("chain_sum", size=24, seed=0, system_prompt=None)


def _config(tmp_path: Path, server, **overrides) -> AsyncGRPOConfig:
    base = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        num_generations=4,
        max_completion_length=12,
        token_budget=384,
        vllm_server_base_url=server.base_url,
        report_to=[],
        save_strategy="no",
        learning_rate=1e-3,
        gradient_checkpointing=False,
        vllm_server_timeout=120,
        rollout_worker_timeout=60,
        seed=0,
    )
    base.update(overrides)
    return AsyncGRPOConfig(**base)


def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


def test_short_run_trains_syncs_and_logs(tmp_path, server, tiny_llama_dir, dataset, caplog):
    args = _config(tmp_path, server)
    built_at = time.time()
    heap = HeapWatch()
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset,
                               callbacks=[RecompileAtStepTwo(), heap])  # fmt: skip
    gc.unfreeze()  # (an in-process engine of an earlier test in this process may have frozen it)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.recompiles"):
        out = trainer.train()
    assert out.global_step == 3
    assert heap.frozen == [True] * 3 and gc.get_freeze_count() == 0  # frozen for train() only
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows[:3]] == [1, 2, 3]
    keys = set().union(*rows[:3])
    for name in (
        "reward",
        "frac_reward_zero_std",
        "perf/weight_sync_s",
        "batch/packing_ratio",
        "entropy",
        "sample/staleness_mean",
        "sampling/importance_sampling_ratio/mean",
        "rewards/parity_reward/mean",
        "rollout/samples_per_rollout",
        "perf/step_s",
    ):
        assert name in keys, name
    # Single-turn rollouts: one training sample each, no turn transition hence no fork metric.
    assert all(r["rollout/samples_per_rollout"] == 1.0 for r in rows if "rollout/samples_per_rollout" in r)
    assert "rollout/fork_frac" not in keys
    assert all(r["perf/step_s"] >= r["perf/fwd_bwd_s"] for r in rows if "perf/step_s" in r)
    undocumented = {k for k in keys if not is_documented_metric(k) and k not in TRAINER_OWN_KEYS}
    assert not undocumented, undocumented
    assert rows[0]["batch/packing_ratio"] > 1.5  # a group's prompt is forwarded once for its 4 completions
    # Step 1 trains samples of the weights the server started with, in fp32 on both sides: the trainer's
    # packed log-probs must reproduce the sampler's (an end-to-end check of packing, temperature and the loss).
    assert rows[0]["sample/staleness_max"] == 0
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-3
    # Start-up figures (issue 41). Step 1 ended after the trainer was built and before its window was written; the
    # clock starts at this (pytest) process's start.
    started = psutil.Process().create_time()
    assert built_at - started <= rows[0]["perf/time_to_first_step_s"] <= rows[0]["time"] - started
    assert all("perf/time_to_first_step_s" not in r for r in rows[1:])
    for k in (1, 2, 3):  # each window: the share of slow steps over steps 1..k, from the logged step times
        times = [r["perf/step_s"] for r in rows[:k]]
        slow = [t for t in times if t > 2 * statistics.median(times)]
        assert rows[k - 1]["perf/warmup_share"] == pytest.approx(sum(slow) / sum(times), abs=1e-12)
    assert [r["perf/recompiles"] for r in rows[:3]] == [0, 1, 1]  # RecompileAtStepTwo's one recompile
    assert "size mismatch at index 0. expected 3, actual 6" in caplog.text and "by step 2" in caplog.text

    # The server now serves the trained weights: its log-probs of its own samples equal the trainer's.
    async def sample():
        async with AsyncServerClient(server.base_url) as client:
            info = await client.weight_info()
            res = await client.generate([1, 2, 3, 4, 5], {"max_tokens": 8, "temperature": 1.0, "seed": 3})
            return info, res, await client.server_info()

    info, res, server_info = asyncio.run(sample())
    ready = server_info.get("asyncgrpo", {}).get("ready_s")  # the server's own start-up time, where it reports one
    assert rows[0].get("perf/server_ready_s") == ready and all("perf/server_ready_s" not in r for r in rows[1:])
    assert info["weight_version"] == "step-3"
    model = trainer.model.float().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, *res.token_ids]])
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        logp = torch.log_softmax(model(ids).logits[0, 4:-1].double(), -1)
    expected = logp.gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(res.logprobs, dtype=torch.float64), expected, atol=1e-4)


@pytest.mark.long  # a scenario of half a minute on 2 cores: `make test-long`
def test_slow_trainer_drops_stale_samples_and_backpressures(tmp_path, server, tiny_llama_dir, dataset):
    args = _config(tmp_path, server, max_staleness=0, max_steps=4)
    trainer = SlowTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset)
    trainer.train()
    rows = _metrics(tmp_path)
    dropped = sum(r.get("sample/dropped_stale_count", 0) for r in rows)
    assert dropped > 0
    assert max(r.get("sample/staleness_max", 0) for r in rows) == 0  # nothing stale was trained
    assert any(r.get("rollout/backpressure_s", 0) > 0.1 for r in rows)  # generation waited for the trainer


def test_raising_reward_function_stops_the_run_with_its_name(tmp_path, server, tiny_llama_dir, dataset):
    """Also covers the fault matrix's kept item (a raising reward is named, the run stops within 120 s)."""
    args = _config(tmp_path, server)
    t0 = time.monotonic()
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[exploding_reward], args=args, train_dataset=dataset)
    with pytest.raises(RolloutWorkerError, match="exploding_reward.*the judge is offline"):
        trainer.train()
    assert time.monotonic() - t0 < 120


@pytest.mark.long  # a fault scenario of half a minute: `make test-long`
def test_killed_worker_stops_the_trainer(tmp_path, server, tiny_llama_dir, dataset):
    """A SIGKILLed worker after step 1: the trainer stops within 30 s, naming the exit code (fault matrix, kept)."""
    from transformers import TrainerCallback

    from tests.helpers.procs import pid_alive

    killed: dict[str, float] = {}

    class KillWorker(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 1:
                killed["pid"] = trainer.worker.process.pid
                os.kill(killed["pid"], signal.SIGKILL)
                killed["at"] = time.monotonic()

    args = _config(tmp_path, server, max_steps=50)
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset)
    trainer.add_callback(KillWorker())
    t0 = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"exited unexpectedly \(exit code -9\)"):
        trainer.train()
    assert time.monotonic() - t0 < 60
    assert time.monotonic() - killed["at"] < 30 and not pid_alive(int(killed["pid"]))


@pytest.mark.long  # a fault scenario of half a minute: `make test-long`
def test_resume_restarts_at_the_first_untrained_prompt(tmp_path, server, tiny_llama_dir, dataset, monkeypatch):
    log = tmp_path / "prompts.log"
    monkeypatch.setenv("ASYNCGRPO_TEST_PROMPT_LOG", str(log))
    args = _config(tmp_path, server, max_steps=2, save_strategy="steps", save_steps=2)
    RecordingTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset).train()
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "rollout_state.json").read_text())
    first = state["first_untrained_prompt"]
    assert 0 < first < len(dataset)
    log.write_text("")
    args = _config(tmp_path, server, max_steps=3, save_strategy="no")
    trainer = RecordingTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset)
    out = trainer.train(resume_from_checkpoint=True)
    assert out.global_step == 3
    asked = [int(x) for x in log.read_text().split()]
    assert asked[:3] == [first, first + 1, first + 2]


def test_epochs_count_distinct_prompts(tmp_path, server, tiny_llama_dir):
    small = reasoning_gym_dataset("chain_sum", size=6, seed=1, system_prompt=None)
    args = _config(tmp_path, server, max_steps=-1, num_train_epochs=1.0)
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=small)
    trainer.train()
    assert trainer.state.epoch == pytest.approx(1.0)
    assert not math.isnan(_metrics(tmp_path)[-1].get("epoch", math.nan))


def test_top_k_renormalises_over_the_sampling_masks(tmp_path, servers, tiny_llama_dir, dataset):
    """G9: with top_k the server returns candidate sets and the trainer renormalises over them, so on-policy
    log-probs agree; without the renormalisation they would differ by log(mass of the top-k set) (> 1 nat here).
    """
    masked = servers[1]  # --return-sampling-mask
    args = _config(tmp_path, masked, max_steps=1, top_k=20, temperature=0.9, log_completions=True,
                   num_completions_to_print=2)  # fmt: skip
    AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset).train()
    first = _metrics(tmp_path)[0]
    assert first["sample/staleness_max"] == 0
    assert first["sampling/sampling_logp_difference/max"] < 1e-3


def test_peft_model_syncs_merged_weights(tmp_path, server, tiny_llama_dir, dataset):
    """A LoRA policy: the server receives W + scale * B A under the base names and then samples like the adapter."""
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    args = _config(tmp_path, server, max_steps=2, learning_rate=5e-2)
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset,
                               peft_config=peft_config)  # fmt: skip
    trainer.train()

    async def sample():
        async with AsyncServerClient(server.base_url) as client:
            return await client.generate([1, 2, 3, 4, 5], {"max_tokens": 6, "temperature": 1.0, "seed": 5})

    res = asyncio.run(sample())
    assert any(p.abs().sum() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)  # B moved off 0
    merged = trainer.model.merge_and_unload().float().eval()
    merged.set_attn_implementation("sdpa")
    ids = torch.tensor([[1, 2, 3, 4, 5, *res.token_ids]])
    with torch.no_grad():
        logp = torch.log_softmax(merged(ids).logits[0, 4:-1].double(), -1)
    expected = logp.gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(res.logprobs, dtype=torch.float64), expected, atol=1e-4)
