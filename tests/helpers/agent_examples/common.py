"""Test settings shared by the reference's agent examples (docs/spec.md, A1-A4) (the scripts beside this file).

The scripts are the reference's examples with the model id and the config pointed at the test's
tiny tool-calling model and embedded server (environment variables set by tests/integration/test_agents_cpu.py).
``record`` appends one JSON line to $AGENT_TEST_LOG so the test can read what happened inside the worker.
"""

from __future__ import annotations

import json
import os
from typing import Any

from asyncgrpo import AsyncGRPOConfig

MODEL = os.environ.get("AGENT_TEST_MODEL", "")


def config(**overrides: Any) -> AsyncGRPOConfig:
    base: dict[str, Any] = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=os.environ.get("AGENT_TEST_OUT", "agent-out"),
        vllm_server_base_url=os.environ.get("AGENT_TEST_SERVER", "http://127.0.0.1:8000"),
        num_generations=4,
        max_completion_length=40,
        token_budget=640,  # a few groups per step: shared prompts are forwarded once
        learning_rate=1e-6,
        temperature=0.5,  # tests.helpers.agent_model.SAMPLING_TEMPERATURE (not imported: it would import torch early)
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        vllm_server_timeout=120,
        rollout_worker_timeout=60,
        max_concurrent_rollouts=4,
        seed=0,
    )
    base.update(overrides)
    return AsyncGRPOConfig(**base)


def record(**fields: Any) -> None:
    path = os.environ.get("AGENT_TEST_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(fields, default=str) + "\n")
