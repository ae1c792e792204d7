"""A real vLLM restarted in the middle of an adapter-sync run (X4, T6), and adapter sync with no weight transfer.

The server is killed (SIGKILL: a crash) at the end of step 2 and started again, this time without
``--weight-transfer-config``. The restarted server knows none of the run's adapters: the trainer's next load
waits for it to answer, and rollouts that name a lost version register it again from the run's adapter
directory. The lane's later tests use the restarted server: ``test_tools_vllm.py`` starts a run against it, which
shows that adapter sync needs no weight transfer (issue 26).
"""

from __future__ import annotations

import threading

import pytest
from peft import LoraConfig
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from tests.vllm_lane.runs import FP32_NOISE, LORA, lane_config, logprob_gap, parity_reward, server_complete

pytestmark = pytest.mark.slow

RESTART_TIMEOUT_S = 900.0  # a vLLM start on two busy cores (tests/vllm_lane/real_vllm.py START_TIMEOUT_S)


class CrashAndRestart(TrainerCallback):
    """At the end of step 2 (before its sync): kill the server, and start it again on a thread."""

    def __init__(self, real_vllm) -> None:
        self.real_vllm = real_vllm
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 2 or self.thread is not None:
            return
        self.real_vllm.kill()
        print("[vllm lane] killed vLLM at the end of step 2; starting it again without weight transfer", flush=True)

        def start() -> None:
            try:
                self.real_vllm.restart(weight_transfer=False)
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc

        self.thread = threading.Thread(target=start, name="vllm-restart", daemon=True)
        self.thread.start()


def test_a_run_survives_a_vllm_restart(tmp_path, real_vllm):
    url = real_vllm.base_url
    starts = len(real_vllm.starts)
    args = lane_config(tmp_path, url, max_steps=4, max_staleness=1, vllm_server_restart_timeout=RESTART_TIMEOUT_S,
                       vllm_server_timeout=RESTART_TIMEOUT_S)  # fmt: skip
    crash = CrashAndRestart(real_vllm)
    dataset = reasoning_gym_dataset("chain_sum", size=32, seed=1, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(real_vllm.model_dir), reward_funcs=[parity_reward], args=args,
                               train_dataset=dataset, peft_config=LoraConfig(**LORA), callbacks=[crash])  # fmt: skip
    trainer.train()
    assert crash.thread is not None
    crash.thread.join(RESTART_TIMEOUT_S)
    assert crash.error is None, crash.error
    assert len(real_vllm.starts) == starts + 1 and not real_vllm.has_weight_transfer
    assert trainer.state.global_step == 4
    newest = server_complete(url, trainer.served_adapter)
    assert trainer.served_adapter == "asyncgrpo-lora-step-4"
    assert logprob_gap(trainer.model, newest) <= FP32_NOISE
