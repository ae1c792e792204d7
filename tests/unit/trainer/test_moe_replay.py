"""MoE routing replay on one MoE block: a small perturbation of the input flips the top-k of some tokens (the
"sampler's" routing); with replay the block's output and gradients equal a forward forced to those experts, written
out here expert by expert from the block's parameters, and the router still gets a gradient."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, OlmoeConfig, Qwen3MoeConfig

from asyncgrpo.trainer.moe_replay import RouterReplay

COMMON = dict(  # noqa: C408
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, num_experts=6, num_experts_per_tok=2,
)  # fmt: skip
N = 48  # tokens


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = (
        Qwen3MoeConfig(head_dim=8, moe_intermediate_size=16, norm_topk_prob=True, **COMMON)
        if arch == "qwen3_moe"
        else OlmoeConfig(norm_topk_prob=False, **COMMON)
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    return model


def _own_topk(block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.topk(torch.softmax(x @ block.gate.weight.T, -1), block.gate.top_k, dim=-1).indices


def _sampler_routing(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a slightly perturbed input (what another kernel/dtype would pick) and which tokens flipped."""
    own = _own_topk(block, x).sort(-1).values
    gen = torch.Generator().manual_seed(1)
    for scale in (1e-3, 3e-3, 1e-2, 3e-2, 1e-1):
        other = _own_topk(block, x + scale * torch.randn(x.shape, generator=gen)).sort(-1).values
        flipped = (other != own).any(-1)
        if 0 < int(flipped.sum()) < N // 2:
            return other, flipped
    raise AssertionError("no perturbation flipped a few tokens' top-k")


def _forced(block, x: torch.Tensor, experts: torch.Tensor, normalise: bool) -> torch.Tensor:
    """The block forward with each token sent to ``experts`` [N, k]: softmax(router)[experts] (renormalised for
    norm_topk_prob models) times each expert's SwiGLU MLP, summed."""
    probs = torch.softmax(x @ block.gate.weight.T, -1)
    w = probs.gather(1, experts)
    if normalise:
        w = w / w.sum(-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (x[t] @ block.experts.gate_up_proj[e].T).chunk(2)
            acc = acc + w[t, j] * ((torch.nn.functional.silu(gate) * up) @ block.experts.down_proj[e].T)
        rows.append(acc)
    return torch.stack(rows)


def _grads(model, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = fn()
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.model.layers[0].mlp.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_replay_equals_a_forward_forced_to_the_sampler_experts(arch):
    model = _model(arch)
    block = model.model.layers[0].mlp
    x = torch.randn(N, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))
    sampler, flipped = _sampler_routing(block, x)
    routing = torch.full((N, 2, 2), -1, dtype=torch.int16)
    routing[:, 0] = sampler.to(torch.int16)
    unrouted = torch.zeros(N, dtype=torch.bool)
    unrouted[::7] = True  # tokens without a sampler routing keep the router's own top-k
    routing[unrouted] = -1
    expected_experts = torch.where(unrouted[:, None], _own_topk(block, x), sampler)

    replay = RouterReplay(model, replay=True)
    replay.begin(routing)
    got, got_grads = _grads(model, lambda: block(x[None])[0])
    replay.end()
    ref, ref_grads = _grads(model, lambda: _forced(block, x, expected_experts, normalise=arch == "qwen3_moe"))
    assert torch.allclose(got, ref, atol=1e-5)
    for name, g in ref_grads.items():
        assert torch.allclose(got_grads[name], g, atol=1e-5), name
    assert got_grads["gate.weight"].abs().sum() > 0  # the router still learns under replay

    # the test has teeth: without replay the flipped (routed) tokens come out differently
    own, _ = _grads(model, lambda: block(x[None])[0])
    changed = (own - ref).abs().amax(-1) > 1e-4
    assert torch.equal(changed, flipped & ~unrouted)
    replay.close()


def test_metrics_count_the_flipped_tokens_and_replay_uses_the_sampler_set():
    model = _model("qwen3_moe")
    block = model.model.layers[0].mlp
    x = torch.randn(N, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))
    sampler, flipped = _sampler_routing(block, x)
    routing = torch.full((N, 2, 2), -1, dtype=torch.int16)
    routing[:, 0] = sampler.to(torch.int16)  # layer 1 carries no routing: it is not counted
    for replay_on, used_share in ((True, 0.0), (False, flipped.float().mean().item())):
        replay = RouterReplay(model, replay=replay_on)
        replay.begin(routing)
        block(x[None])
        replay.end_forward()
        block(x[None])  # a recomputation (activation checkpointing) is not counted twice
        replay.end()
        metrics = replay.take_metrics()
        replay.close()
        share = flipped.float().mean().item()
        assert metrics["moe/router_disagreement/mean"] == pytest.approx(share)  # one routed layer: mean = max
        assert metrics["moe/router_disagreement/max"] == pytest.approx(share)
        assert metrics["moe/routing_mismatch/max"] == pytest.approx(used_share)
        assert replay.take_metrics() == {}  # taken: the next window starts empty


def test_replay_refuses_routing_of_another_model():
    model = _model("qwen3_moe")
    replay = RouterReplay(model, replay=True)
    with pytest.raises(ValueError, match="routes 2 experts per token"):
        replay.begin(torch.zeros(5, 2, 3, dtype=torch.int16))
    dense = AutoModelForCausalLM.from_config(
        Qwen3MoeConfig(head_dim=8, **{**COMMON, "num_experts": 0}), dtype=torch.float32
    )
    with pytest.raises(ValueError, match="router_replay=False"):
        RouterReplay(dense, replay=True)


def test_replay_finds_the_routers_of_a_lora_model_and_replays_them():
    from peft import LoraConfig, get_peft_model

    model = _model("olmoe")
    block = model.model.layers[0].mlp
    x = torch.randn(N, COMMON["hidden_size"], generator=torch.Generator().manual_seed(0))
    sampler, _ = _sampler_routing(block, x)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    replay = RouterReplay(peft, replay=True)
    assert [layer for layer, _ in replay.routers] == [0, 1]
    routing = torch.full((N, 2, 2), -1, dtype=torch.int16)
    routing[:, 0] = sampler.to(torch.int16)
    replay.begin(routing)
    got = block(x[None])[0]
    replay.end()
    ref = _forced(block, x, sampler, normalise=False)
    assert torch.allclose(got, ref, atol=1e-5)


def test_checkpointed_layers_recompute_with_the_same_routing():
    """Activation checkpointing re-runs each decoder layer inside backward: gradients under replay equal those of
    the same forward without checkpointing."""
    model = _model("qwen3_moe")
    ids = torch.randint(0, COMMON["vocab_size"], (1, N), generator=torch.Generator().manual_seed(2))
    routing = torch.full((N, 2, 2), -1, dtype=torch.int16)
    routing[:, :, 0] = torch.arange(N)[:, None] % 6  # forced pairs (e, e+1): far from the router's own choice
    routing[:, :, 1] = (torch.arange(N)[:, None] + 1) % 6
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model.zero_grad()
        replay = RouterReplay(model, replay=True)
        replay.begin(routing)
        out = model(input_ids=ids).logits
        replay.end_forward()
        out.float().pow(2).mean().backward()
        replay.end()
        replay.close()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.allclose(grads[1][name], g, atol=1e-6), name
