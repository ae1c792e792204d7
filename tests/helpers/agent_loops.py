"""Tool-loop rollouts driven in process, shared by the agent pipeline tests and the trained-model test.

``ScriptedTurns`` stands in for the server where a test is about the pipeline (forks, slow tools), not about what
a model writes; ``server_turn`` asks a real server. ``packed_and_reference`` computes the trained tokens' log-probs
packed and, as the independent reference, one unpacked forward per sample.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.packing import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.rollout.agents import ToolLoopSettings, run_tool_loop
from asyncgrpo.rollout.reconcile import ReconcileStats, rollout_to_sequences
from asyncgrpo.trainer.logprobs import selective_logprobs
from asyncgrpo.types import TurnRecord
from tests.helpers import agent_model
from tests.helpers.agent_examples import doc_tools


class ScriptedTurns:
    """``generate_turn`` writing fixed assistant texts in order, each token with its own known log-prob."""

    def __init__(self, tok, texts: list[str]) -> None:
        self.tok, self.texts, self.logprobs = tok, list(texts), []

    async def __call__(self, prompt_ids: list[int]) -> TurnRecord:
        await asyncio.sleep(0)  # a real turn yields to the loop: rollouts interleave
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        lps = [-(len(self.logprobs) + k + 1) / 1000 for k in range(len(ids))]
        self.logprobs += lps
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=ids, output_log_probs=lps)


def server_turn(client: AsyncServerClient, max_tokens: int = 64, temperature: float = agent_model.SAMPLING_TEMPERATURE):
    async def turn(prompt_ids: list[int]) -> TurnRecord:
        params = {"max_tokens": max_tokens, "temperature": temperature, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                  "logprobs": 0, "seed": len(prompt_ids)}  # fmt: skip
        res = await client.complete(prompt_ids, params)
        return TurnRecord(prompt_ids=list(prompt_ids), output_ids=res.token_ids, output_log_probs=res.logprobs)

    return turn


def render_with(tok):
    def render(messages, schemas):
        enc = tok.apply_chat_template(messages, tools=schemas or None, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    return render


async def fork_rollouts_async(tok, turns: list, tools=(doc_tools.multiply,)):
    settings = ToolLoopSettings(max_iterations=3, max_model_len=1024)
    prompt = [{"role": "user", "content": agent_model.FORK_PROMPT}]
    return await asyncio.gather(*(
        run_tool_loop(prompt, list(tools), render=render_with(tok), generate_turn=turn, executor=None, settings=settings,
                      decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
        for turn in turns
    ))  # fmt: skip


def fork_rollouts(tok, turns: list):
    return asyncio.run(fork_rollouts_async(tok, turns))


def packed_and_reference(model_dir: Path, samples: list[PackSample], temperature: float = 1.0):
    """(packed log-probs at ``temperature``, per-sample unpacked forwards at 1.0) of the trained tokens.

    The model runs in float64 (the packed log-softmax itself stays float32): a warmed-up model's logits are
    large, so float32 forwards alone move a confident token's log-prob by ~2e-4 between two correct paths.
    """
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    reference = []
    with torch.no_grad():
        for s in samples:
            ids = torch.as_tensor(np.asarray(s.token_ids))[None]
            logp = model(input_ids=ids).logits[0].log_softmax(-1)
            t = torch.from_numpy(np.flatnonzero(s.loss_mask))
            reference.append(logp[t - 1].gather(1, ids[0, t][:, None])[:, 0])
        row = pack_samples(samples)
        use_tree_attention(model)
        hidden = packed_hidden_states(model, row, build_plan(row))
        head = model.get_output_embeddings().weight
        packed = selective_logprobs(hidden[row.pred_index], head, row.target_ids, temperature=temperature)
    return packed.logprobs, torch.cat(reference)


def sequences_of(results, stats: ReconcileStats):
    return [rollout_to_sequences(r, group_id=0, row_index=0, model_version=0, num_sampler_logprobs=None, stats=stats)
            for r, _ in results]  # fmt: skip
