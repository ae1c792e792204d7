"""Routing replay end to end on CPU: a bf16 ``asyncgrpo serve --enable-return-routed-experts`` samples tiny OLMoE-
and Qwen3-MoE-shaped models, the client parses the routing, reconciliation carries it through a two-turn episode,
the packer into trie and flat rows, and the fp32 trainer replays it.

Checks: the server's ids arrive in the packed row at the right positions (the tool tokens routed by the second
turn's prefill, the last sampled token unrouted); with replay the trainer's log-probs are closer to the sampler's
than without (mean |d logp| printed both ways) and the experts it uses never differ from the sampler's; trie
rows = flat rows = each sample forwarded alone (padded batch of one) under replay.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.reconcile import rollout_to_sequences
from asyncgrpo.trainer.logprobs import selective_logprobs
from asyncgrpo.trainer.moe_replay import RouterReplay
from asyncgrpo.types import Rollout, RoutedTurn
from tests.helpers.moe_models import sharp_moe_dir

pytestmark = [pytest.mark.slow, pytest.mark.long]  # ~20 s per model on 2 cores: `make test-long`

PROMPT = list(range(40, 60))
TOOL = [7, 8, 9, 10]  # a tool result between the two turns: context, never sampled


async def _episodes(url: str, n: int) -> list[Rollout]:
    """``n`` two-turn rollouts: the second turn re-sends turn 1 + a tool result and asks only for new rows."""
    params = {"max_tokens": 16, "temperature": 1.0, "seed": 0}
    async with AsyncServerClient(url) as client:
        firsts = await client.complete_n(PROMPT, {**params, "n": n})
        rollouts = []
        for first in firsts:
            history = PROMPT + first.token_ids + TOOL
            start = len(PROMPT) + len(first.token_ids) - 1  # rows held so far: every token but the last sampled
            second = await client.complete(history, {**params, "routed_experts_prompt_start": start})
            turns = [
                RoutedTurn(PROMPT, first.token_ids, first.logprobs, routed_experts=first.routed_experts),
                RoutedTurn(history, second.token_ids, second.logprobs, routed_experts=second.routed_experts,
                           routed_experts_start=start),
            ]  # fmt: skip
            rollouts.append(Rollout([], first.token_ids + second.token_ids, turns))
    return rollouts


def _logprobs(model, row, routing, replay: bool) -> tuple[torch.Tensor, dict[str, float]]:
    hooks = RouterReplay(model, replay=replay)
    hooks.begin(routing)
    with torch.no_grad():
        hidden = packed_hidden_states(model, row, build_plan(row, "sdpa"))
        lp = selective_logprobs(hidden[row.pred_index], model.get_output_embeddings().weight, row.target_ids,
                                chunk_size=64).logprobs  # fmt: skip
    hooks.end()
    metrics = hooks.take_metrics()
    hooks.close()
    return lp, metrics


@pytest.mark.parametrize("arch", ["olmoe", "qwen3_moe"])
def test_server_routing_replayed_in_the_trainer(arch, serve, tmp_path):
    model_dir = sharp_moe_dir(arch, tmp_path)
    server = serve(model_dir, "--max-model-len", "256", "--kv-cache-tokens", "4096", "--dtype", "bfloat16",
                   "--enable-return-routed-experts")  # fmt: skip
    rollouts = asyncio.run(_episodes(server.base_url, 4))
    seqs = [s for i, r in enumerate(rollouts) for s in rollout_to_sequences(
        r, group_id=0, row_index=i, model_version=0, num_sampler_logprobs=None)]  # fmt: skip
    assert len(seqs) == 4  # each two-turn episode extends one sequence
    for seq, r in zip(seqs, rollouts):
        seq.validate()
        first, second = r.turns
        n1 = len(PROMPT) + len(first.output_ids)
        np.testing.assert_array_equal(seq.routed_experts[: n1 - 1], first.routed_experts)
        np.testing.assert_array_equal(seq.routed_experts[n1 - 1 : -1], second.routed_experts)  # tool rows included
        assert (seq.routed_experts[-1] == -1).all()  # the last sampled token was never forwarded

    samples = [PackSample.from_sequence(s) for s in seqs]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_tree_attention(model)
    trie, flat = pack_samples(samples), pack_samples(samples, share_prefixes=False)
    assert trie.num_tokens < flat.num_tokens  # the prompt is shared
    lp_trie, m_trie = _logprobs(model, trie, trie.routed_experts, replay=True)
    lp_flat, _ = _logprobs(model, flat, flat.routed_experts, replay=True)
    lp_own, m_own = _logprobs(model, flat, flat.routed_experts, replay=False)
    # each sample alone, as a padded batch of one would run it
    alone = torch.cat([_logprobs(model, pack_samples([s]), torch.from_numpy(s.routed_experts), True)[0]
                       for s in samples])  # fmt: skip
    torch.testing.assert_close(lp_trie, lp_flat, atol=2e-5, rtol=0)
    torch.testing.assert_close(lp_flat, alone, atol=2e-5, rtol=0)

    sampler = flat.old_logprobs
    gap_replay, gap_own = (lp_flat - sampler).abs().mean().item(), (lp_own - sampler).abs().mean().item()
    print("MOE_REPLAY", json.dumps({"arch": arch, "mean_abs_dlogp_replay": gap_replay, "mean_abs_dlogp_own": gap_own,
                                    **{f"replay_off/{k}": v for k, v in m_own.items()}}))  # fmt: skip
    assert m_own["moe/router_disagreement/max"] > 0  # bf16 sampling flips some top-k sets...
    assert m_own["moe/routing_mismatch/mean"] == m_own["moe/router_disagreement/mean"]
    assert m_trie["moe/routing_mismatch/max"] == 0.0  # ...which replay uses exactly as sampled
    assert gap_replay < gap_own


def test_a_training_run_replays_the_server_routing(serve, tmp_path):
    """The whole pipeline (worker, queue, packer, trainer, weight sync) with ``router_replay=True``: every
    trained row carries routing, the experts used never differ from the sampler's, the routers' own disagreement
    is logged, and the step syncs."""
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
    from tests.helpers.rewards import even_token_reward

    model_dir = sharp_moe_dir("qwen3_moe", tmp_path / "model")
    server = serve(model_dir, "--max-model-len", "256", "--kv-cache-tokens", "8192", "--dtype", "bfloat16",
                   "--enable-return-routed-experts")  # fmt: skip
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, num_generations=4, max_completion_length=8, token_budget=256,
        vllm_server_base_url=server.base_url, report_to=[], save_strategy="no", learning_rate=1e-3, seed=0,
        gradient_checkpointing=True, vllm_server_timeout=120, rollout_worker_timeout=60, logging_steps=1,
        router_replay=True, max_staleness=0,
    )  # fmt: skip
    dataset = reasoning_gym_dataset("chain_sum", size=8, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(model_dir), reward_funcs=[even_token_reward], args=args, train_dataset=dataset)
    assert trainer.router_replay is not None and trainer.router_replay.replay
    assert trainer.train().global_step == 2
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "moe/routing_mismatch/max" in r]
    assert len(trained) == 2 and all(r["moe/routing_mismatch/max"] == 0.0 for r in trained)
    assert all(0.0 <= r["moe/router_disagreement/mean"] <= 1.0 for r in trained)
    assert all(r["sampling/sampling_logp_difference/mean"] < 0.01 for r in trained)  # on-policy, bf16 vs fp32
    config = json.loads((tmp_path / "out" / "run_config.json").read_text())
    assert config["mixture_of_experts"] is True and config["args"]["router_replay"] is True


class TwoTurnLoop(AsyncRolloutLoop):
    """Each rollout: a first turn, a fixed 'tool result', a second turn on the whole conversation."""

    async def generate_one(self, prompt, tools, group_id=0):
        first = await self.generate_one_turn(self.render_prompt(prompt))
        second = await self.generate_one_turn(first.prompt_ids + first.output_ids + TOOL)
        ids = first.output_ids + second.output_ids
        return Rollout([{"role": "assistant", "content": ""}], ids, [first, second])


def test_two_turn_rollouts_of_the_worker_carry_every_row(serve, tmp_path):
    """The real worker's turns (one task per rollout, ``routed_experts_prompt_start`` on the second): every
    token of each trained sample has the sampler's routing but the last sampled one, tool tokens included."""
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
    from tests.helpers.rewards import even_token_reward

    class Trainer(AsyncGRPOTrainer):
        loop_cls = TwoTurnLoop

    model_dir = sharp_moe_dir("olmoe", tmp_path / "model")
    server = serve(model_dir, "--max-model-len", "256", "--kv-cache-tokens", "8192", "--enable-return-routed-experts")
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, num_generations=4, max_completion_length=6, token_budget=512,
        vllm_server_base_url=server.base_url, report_to=[], save_strategy="no", learning_rate=1e-3, seed=0,
        gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=60, router_replay=True,
    )  # fmt: skip
    dataset = reasoning_gym_dataset("chain_sum", size=8, seed=0, system_prompt=None)
    trainer = Trainer(str(model_dir), reward_funcs=[even_token_reward], args=args, train_dataset=dataset)
    assert trainer.train().global_step == 1
    samples = [s for mb in trainer.step_stats.micro_batches for row in mb.pack() for s in row.samples]
    assert samples
    for s in samples:
        routed, ids = s.routed_experts, list(s.token_ids)
        assert routed is not None and (routed[:-1] >= 0).all() and (routed[-1] == -1).all()
        # the tool result follows the first turn's last sampled token; the second turn's prefill routed it
        at = next(i for i in range(1, len(ids)) if ids[i : i + len(TOOL)] == TOOL and s.loss_mask[i - 1])
        assert (routed[at - 1 : at + len(TOOL)] >= 0).all()
