"""The agent pipeline on scripted turns (issue 8 forks and slow tools; issue 25): what these tests check never
depends on what a model writes on this machine.

The turns are fixed texts with known log-probs (``tests/helpers/agent_loops.ScriptedTurns``); the model that
scores them is the suite's tiny random-init Llama, checked against one unpacked forward per sample. The trained
tool model's own calls are tested in ``test_agents_cpu.py`` (the long lane).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asyncgrpo.assets import smollm2_tokenizer
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.rollout.agents import ToolLoopSettings, prepare_tool_template, run_tool_loop
from asyncgrpo.rollout.reconcile import ReconcileStats
from tests.helpers import agent_model
from tests.helpers.agent_loops import ScriptedTurns, fork_rollouts, packed_and_reference, render_with, sequences_of


@pytest.fixture(scope="module")
def tok():
    """The real SmolLM2 tokenizer with the tool-calling template, as the trained tool model has it."""
    tokenizer = smollm2_tokenizer()
    prepare_tool_template(tokenizer)
    return tokenizer


def tool_messages(completion: list[dict]) -> list[str]:
    return [m["content"] for m in completion if m["role"] == "tool"]


def test_forked_rollout_trains_each_token_once_and_packed_logprobs_match_unpacked(tiny_llama_dir, tok):
    tok.chat_template = agent_model.REASONING_DROPPING_TEMPLATE  # drops earlier <think> blocks: forks
    fork = agent_model.fork_transcript()
    written = [m["content"] for m in fork.messages if m["role"] == "assistant"]
    scripts = [ScriptedTurns(tok, written) for _ in range(4)]
    results = fork_rollouts(tok, scripts)
    stats = ReconcileStats()
    seqs_per_rollout = sequences_of(results, stats)
    assert stats.forks == 4, [r.completion for r, _ in results]  # one fork per rollout: the think block is dropped
    for (rollout, _), seqs, script in zip(results, seqs_per_rollout, scripts):
        assert [m["content"] for m in rollout.completion] == [written[0], "25", written[1]]  # the tool really ran
        trained = [t for s in seqs for t, k in zip(s.input_ids, s.loss_mask) if k]
        assert trained == rollout.completion_ids  # each generated token exactly once, tool tokens never
        carried = [lp for s in seqs for lp, k in zip(s.sampler_logprobs, s.loss_mask) if k]
        assert carried == pytest.approx(script.logprobs)  # each token keeps the log-prob it was sampled with
    samples = [PackSample.from_sequence(s) for seqs in seqs_per_rollout for s in seqs]
    packed, reference = packed_and_reference(tiny_llama_dir, samples)
    assert torch.allclose(packed.double(), reference, rtol=0, atol=1e-5)


def test_slow_sync_tool_does_not_stall_other_rollouts(tok):
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def slow_multiply(a: int, b: int) -> int:  # same name and schema as the transcripts' tool
        t0 = time.perf_counter()
        result = agent_model.slow_multiply(a, b)
        with lock:
            spans.append((t0, time.perf_counter()))
        return result

    slow_multiply.__doc__ = agent_model.slow_multiply.__doc__
    written = [agent_model.call("slow_multiply", a=3, b=4), "Done."]

    async def rollouts():
        executor = ThreadPoolExecutor(max_workers=8)
        return await asyncio.gather(*(
            run_tool_loop(
                [{"role": "user", "content": agent_model.SLOW_PROMPT}], [slow_multiply], render=render_with(tok),
                generate_turn=ScriptedTurns(tok, written), decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                executor=executor, settings=ToolLoopSettings(max_iterations=2, max_model_len=1024),
            )
            for _ in range(6)
        ))  # fmt: skip

    results = asyncio.run(rollouts())
    assert [tool_messages(r.completion) for r, _ in results] == [["12"]] * 6
    assert len(spans) == 6
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak > 1, spans  # sync tool calls of different rollouts ran at the same time
