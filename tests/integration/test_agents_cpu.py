"""Agent training end to end on CPU (issue 8 acceptance): tools, environments, multi-turn, against real processes.

The model is a tiny Llama warmed up to emit ``<tool_call>`` blocks and checked to reproduce its transcripts
(tests/helpers/agent_model.py), served by a real ``asyncgrpo serve``. The reference's examples (docs/spec.md;
tests/helpers/agent_examples) run as scripts, the way a user starts them: each spawns its rollout worker, which
re-imports the script, so the ``__main__`` guard and module-level tools are exercised; their tool calls are text the
model sampled, parsed by the tool loop. One greedy test has the trained model make the call itself through the
server. The pipeline tests on scripted turns (forks, slow tools) are in test_agent_pipeline_cpu.py, in ``make test``;
this file is in the long lane (``make test-long``): the tool model's build and check alone take minutes on 2 cores."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.metrics import is_documented_metric
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.rollout.reconcile import ReconcileStats
from tests.helpers import agent_model
from tests.helpers.agent_loops import fork_rollouts_async, packed_and_reference, sequences_of, server_turn

pytestmark = [pytest.mark.slow, pytest.mark.long]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "tests" / "helpers" / "agent_examples"
TRAINER_OWN_KEYS = {"loss", "grad_norm", "learning_rate", "epoch", "step", "time"}
SCRIPT_TIMEOUT_S = 300
TEMPERATURE = agent_model.SAMPLING_TEMPERATURE


@pytest.fixture(scope="module")
def tool_model() -> Path:
    return agent_model.tool_model_dir()


@pytest.fixture(scope="module")
def server(serve, tool_model):
    return serve(tool_model, "--max-model-len", "1024", "--kv-cache-tokens", "32768")


def run_example(name: str, tmp_path: Path, server, tool_model) -> tuple[list[dict], list[dict]]:
    """Run one example script; return its metrics.jsonl rows and the records it logged."""
    log = tmp_path / "records.jsonl"
    env = {
        **os.environ,
        "AGENT_TEST_MODEL": str(tool_model),
        "AGENT_TEST_SERVER": server.base_url,
        "AGENT_TEST_OUT": str(tmp_path / "out"),
        "AGENT_TEST_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")], check=False, env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train_runtime" not in r]  # Trainer's end-of-run summary
    records = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    undocumented = {k for r in rows for k in r if not is_documented_metric(k) and k not in TRAINER_OWN_KEYS}
    assert not undocumented, undocumented
    return rows, records


def total(rows: list[dict], name: str) -> float:
    return sum(r.get(name, 0.0) for r in rows if r.get(name) == r.get(name))


def tool_messages(completion: list[dict]) -> list[str]:
    return [m["content"] for m in completion if m["role"] == "tool"]


def test_doc_tools_example_counts_calls_failures_unknown_names_and_exhaustion(tmp_path, server, tool_model):
    rows, records = run_example("doc_tools", tmp_path, server, tool_model)
    by_prompt: dict[str, list[list[dict]]] = {}
    for r in records:
        by_prompt.setdefault(r["prompt"], []).append(r["completion"])
    assert set(by_prompt) >= {"Divide 8 by 2.", "Multiply 6 by nothing.", "Keep multiplying 2 by 2."}
    # Conversations: results of real calls parsed from the model's text.
    assert any("no tool named 'divide'" in t for c in by_prompt["Divide 8 by 2."] for t in tool_messages(c))
    assert any(t.startswith("Error: TypeError") for c in by_prompt["Multiply 6 by nothing."] for t in tool_messages(c))
    if "Add 2 and 5." in by_prompt:  # the async tool
        assert any("7" in tool_messages(c) for c in by_prompt["Add 2 and 5."])
    exhausted = [c for c in by_prompt["Keep multiplying 2 by 2."] if len(tool_messages(c)) == 2]
    assert exhausted, "max_tool_calling_iterations=2 should stop the endless caller after two executed turns"
    assert all(len(tool_messages(c)) <= 2 for cs in by_prompt.values() for c in cs)
    assert [m["role"] for m in exhausted[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    # Metrics, as docs/metrics.md names them.
    assert total(rows, "tools/unknown_name_count") >= 1
    assert total(rows, "tools/multiply/call_count") >= 2 and total(rows, "tools/multiply/failure_count") >= 1
    assert max(r.get("tools/loop_exhausted_frac", 0.0) for r in rows) > 0
    assert max(r.get("tools/failure_frequency", 0.0) for r in rows) > 0
    assert any(r.get("tools/call_frequency", 0) > 0 for r in rows)
    assert any("tools/latency_s" in r and "tools/multiply/latency_s" in r for r in rows)
    assert max(r.get("rollout/turns_max", 0) for r in rows) == 3
    assert all("env/reset_s" not in r for r in rows)  # no environment in this run
    assert rows[-1]["step"] == 3


def test_doc_env_self_sampling_example(tmp_path, server, tool_model):
    rows, records = run_example("doc_env_self", tmp_path, server, tool_model)
    assert rows[-1]["step"] == 2
    assert all(1 <= r["target"] <= 6 for r in records)
    instances = {r["instance"] for r in records}
    assert len(instances) <= 4  # max_concurrent_rollouts: one instance per concurrent rollout
    assert max(r["episodes"] for r in records) >= 2  # instances are reused across episodes
    assert any(r["counter"] == r["target"] for r in records)  # the increment tool changed the env's state
    for name in ("rewards/IncrementEnv/mean", "env/reset_s", "env/reward_s", "tools/increment/call_count"):
        assert any(name in r for r in rows), name
    assert total(rows, "tools/increment/call_count") > 0


def test_doc_env_dataset_example_passes_columns_to_reset_and_sums_rewards(tmp_path, server, tool_model):
    rows, records = run_example("doc_env_dataset", tmp_path, server, tool_model)
    resets = [r for r in records if "reset_target" in r]
    assert resets
    for r in resets:
        assert r["prompt"] == f"Increment the counter to {r['reset_target']}."  # the row's target column
        assert r["columns"] == ["prompt"]
    both = [r for r in rows if "rewards/IncrementEnv/mean" in r and "rewards/format_reward/mean" in r]
    assert both
    for r in both:  # every completion is scored by both sources: the mean total is the sum of the means
        assert r["reward"] == pytest.approx(r["rewards/IncrementEnv/mean"] + r["rewards/format_reward/mean"], abs=1e-6)


def test_doc_env_dict_example_routes_and_shows_only_that_environments_tools(tmp_path, server, tool_model):
    rows, records = run_example("doc_env_dict", tmp_path, server, tool_model)
    shown = [r for r in records if "shown_tools" in r]
    coding = [r for r in shown if r["prompt"].startswith("Compute the")]
    game = [r for r in shown if r["prompt"] == "Reach the goal tile."]
    assert coding and game and len(coding) + len(game) == len(shown)
    assert all(r["shown_tools"] == ["run_code"] for r in coding)
    assert all(r["shown_tools"] == ["move"] for r in game)
    assert all(r["reset_kwargs"] == [] for r in records if "reset_kwargs" in r)  # `environment` is not passed
    scored = [r for r in records if "completion" in r]
    assert any("rewards/reward_func/mean" in r for r in rows)
    for r in scored:
        own = "run_code" if r["env"] == "coding" else "move"
        assert r["prompt"].startswith("Compute the") == (r["env"] == "coding")
        for m in r["completion"]:
            if m["role"] == "tool":
                assert m["name"] in (own, ""), m
    assert any(m["role"] == "tool" for r in scored for m in r["completion"])


# ---------------------------------------------------------------------------------------------- the trained model
# The pipeline tests on scripted turns (forks, slow tools) are in test_agent_pipeline_cpu.py. Here the trained model
# itself calls the tool, through the server; the fixture's check guarantees its turns (with a margin).


def test_trained_model_calls_the_tool_through_the_server_and_the_server_agrees(server, tool_model):
    """Greedy through the real server: the warmed-up model's own call, its fork, and the server's log-probs."""
    tok = AutoTokenizer.from_pretrained(tool_model)
    tok.chat_template = agent_model.REASONING_DROPPING_TEMPLATE

    async def turns():
        async with AsyncServerClient(server.base_url) as client:
            return await fork_rollouts_async(tok, [server_turn(client, temperature=0.0)] * 2)

    results = asyncio.run(turns())
    written = [m["content"] for m in agent_model.fork_transcript().messages if m["role"] == "assistant"]
    for rollout, _ in results:  # tool_model_check guarantees these turns, with a margin, on any machine
        assert [m["content"] for m in rollout.completion] == [written[0], "25", written[1]], rollout.completion
    stats = ReconcileStats()
    seqs_per_rollout = sequences_of(results, stats)
    assert stats.forks == 2
    samples = [PackSample.from_sequence(s) for seqs in seqs_per_rollout for s in seqs]
    packed, reference = packed_and_reference(tool_model, samples)  # greedy: log-probs at temperature 1
    sampler = torch.tensor([lp for s in samples for lp, k in zip(s.old_logprobs, s.loss_mask) if k])
    assert torch.allclose(packed.double(), reference, rtol=0, atol=1e-5)
    assert torch.allclose(packed, sampler, rtol=0, atol=1e-3)  # the server (float32) agrees
