"""Issue 43 with real training on the CPU: TRL 1.16's ``rollout_worker=`` / ``weight_transfer=`` plug-ins train,
a missing method is named, and the two timeouts are real: a stalled weight transfer and a server that never
answers a generation request both stop the run within their timeout, naming it, with the checkpoints and
metrics written so far intact.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.errors import WeightSyncTimeoutError
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from tests.helpers.trl_plugins import CopyWeightTransfer, LocalGenerator, ThreadRolloutWorker

pytestmark = pytest.mark.slow


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.fixture(scope="module")
def dataset():
    return reasoning_gym_dataset("chain_sum", size=16, seed=0, system_prompt=None)


def _config(tmp_path: Path, **overrides) -> AsyncGRPOConfig:
    base = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(tmp_path / "out"), max_steps=3, num_generations=4, token_budget=256, report_to=[],
        save_strategy="no", learning_rate=1e-3, gradient_checkpointing=False, score_centering=False, seed=0,
    )  # fmt: skip
    base.update(overrides)
    return AsyncGRPOConfig(**base)


def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


def test_a_user_rollout_worker_and_weight_transfer_train(tmp_path, tiny_llama_dir, dataset):
    generator = LocalGenerator(tiny_llama_dir)
    transfer, worker = CopyWeightTransfer(generator), ThreadRolloutWorker(generator)
    args = _config(tmp_path, vllm_server_base_url="http://127.0.0.1:9")  # nothing listens: no server is needed
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset,
                               rollout_worker=worker, weight_transfer=transfer)  # fmt: skip
    assert trainer.rollout_worker is worker and trainer.weight_transfer is transfer
    out = trainer.train()
    assert out.global_step == 3
    # TRL's order: init once, then pause -> send -> resume per sync (train begin + after each step), destroy last.
    assert transfer.calls == ["init_weight_transfer", *["pause", "send_weights", "resume"] * 4, "destroy"]
    # The version the server's weights carry: 0 at train begin (told by the push and again at the start), then
    # each optimizer step after its push.
    assert worker.started == 1 and worker.stopped == 1 and worker.versions == [0, 0, 1, 2, 3]
    # Every parameter the server needs reached the user's copy: it now holds the trained weights.
    trained = dict(trainer.model.named_parameters())
    assert set(transfer.last_received) == set(trained)
    for name, tensor in generator.model.named_parameters():
        assert torch.equal(tensor, trained[name].detach()), name
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows[:3]] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows[:3])
    assert rows[0]["sample/staleness_max"] == 0
    # The user's sampler log-probs are the trainer's own at step 1 (same weights, fp32): the weights arrived
    # exactly and the samples' old_log_probs line up with their tokens.
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-3
    # The worker's own metrics_queue reached the log: a value, and a (numerator, denominator) rate.
    assert all(r["rollout/user_generate_s"] > 0 and 0 <= r["rollout/user_even_frac"] <= 1 for r in rows[:3])
    assert all(r["perf/weight_sync_s"] >= 0 for r in rows[:3])


def test_a_missing_protocol_method_is_named_at_construction(tmp_path, tiny_llama_dir, dataset):
    class NoDestroy(CopyWeightTransfer):
        destroy = None  # type: ignore[assignment]

    generator = LocalGenerator(tiny_llama_dir)
    with pytest.raises(TypeError, match=r"weight_transfer=NoDestroy has no method destroy\(\)"):
        AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=_config(tmp_path),
                         train_dataset=dataset, weight_transfer=NoDestroy(generator))  # fmt: skip

    class NoVersion(ThreadRolloutWorker):
        update_model_version = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"rollout_worker=NoVersion has no method update_model_version\(\)"):
        AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=_config(tmp_path),
                         train_dataset=dataset, rollout_worker=NoVersion(generator))  # fmt: skip


def test_a_stalled_weight_transfer_fails_within_weight_sync_timeout(tmp_path, tiny_llama_dir, dataset, record_property):
    generator = LocalGenerator(tiny_llama_dir)
    transfer = CopyWeightTransfer(generator, stall_from=3)  # sends 0 (train begin), 1, 2 pass; after step 3: hangs
    worker = ThreadRolloutWorker(generator)
    args = _config(tmp_path, max_steps=20, save_strategy="steps", save_steps=1, weight_sync_timeout=3)
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset,
                               rollout_worker=worker, weight_transfer=transfer)  # fmt: skip
    with pytest.raises(WeightSyncTimeoutError, match=r"send_weights\(\) did not return within weight_sync_timeout=3s"):
        trainer.train()
    failed_after = time.monotonic() - transfer.paused_at  # the stalled round's start
    record_property("failed_after_s", round(failed_after, 3))  # --junitxml keeps the measurement
    # The round's clock starts just before pause() runs (on its helper thread): allow that start-up below 3 s.
    assert transfer.stalled_at is not None and 3.0 - 0.2 <= failed_after < 3.0 + 5.0, failed_after
    assert worker.stopped == 1 and transfer.calls[-1] == "destroy"  # the run still cleaned up
    # Nothing written is lost: checkpoint-2 holds exactly the weights of the last completed transfer, and the
    # metrics file has every logged step, each a whole JSON line.
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    saved = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2", dtype=torch.float32)
    for name, tensor in saved.named_parameters():
        assert torch.equal(tensor, transfer.last_received[name]), name
    assert json.loads((out / "checkpoint-2" / "rollout_state.json").read_text())
    assert [r["step"] for r in _metrics(tmp_path) if "loss" in r] == [1, 2]
    assert transfer.sends == 3
