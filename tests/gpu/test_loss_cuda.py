"""The pure loss and config on a CUDA device: same numbers as on CPU, bf16 inputs upcast, bf16 default on."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.trainer.loss import policy_loss

pytestmark = pytest.mark.gpu


def _inputs(device, dtype):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    tokens = torch.randint(0, 50, (64,), generator=g)
    top_ids = torch.topk(logits, 8, dim=-1).indices
    s_all = torch.log_softmax(logits + 0.2 * torch.randn(64, 50, generator=g), -1)
    slp = s_all.gather(1, tokens[:, None]).squeeze(1)
    s_top = s_all.gather(1, top_ids)
    s_top[::5, -1] = -float("inf")  # padding slots
    adv = torch.randn(64, generator=g)
    mask = torch.rand(64, generator=g) > 0.2
    mask[0] = False
    sample_index = torch.arange(64) // 16
    leaf = logits.to(device=device, dtype=dtype).requires_grad_(True)
    return leaf, [t.to(device) for t in (tokens, top_ids, slp, s_top, adv, mask, sample_index)]


def _run(device, dtype, score_centering):
    leaf, (tokens, top_ids, slp, s_top, adv, mask, sample_index) = _inputs(device, dtype)
    logp = torch.log_softmax(leaf.float(), -1)
    out = policy_loss(
        logp.gather(1, tokens[:, None]).squeeze(1).to(dtype),
        slp,
        adv,
        mask,
        float(mask.sum()),
        score_centering=score_centering,
        top_logprobs=logp.gather(1, top_ids).to(dtype),
        sampler_top_logprobs=s_top,
        sample_index=sample_index,
    )
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out.loss.detach().cpu().double(), grad.cpu().double(), {k: v for k, v, _ in out.metric_events()}


@pytest.mark.parametrize("score_centering", [True, False])
def test_cuda_matches_cpu(score_centering):
    cpu_loss, cpu_grad, cpu_m = _run("cpu", torch.float32, score_centering)
    gpu_loss, gpu_grad, gpu_m = _run("cuda", torch.float32, score_centering)
    torch.testing.assert_close(gpu_loss, cpu_loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gpu_grad, cpu_grad, rtol=1e-3, atol=1e-6)
    for name, value in cpu_m.items():
        assert gpu_m[name] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), name


def test_bf16_inputs_are_upcast():
    loss, grad, metrics = _run("cuda", torch.bfloat16, True)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert 0.0 < metrics["sampling/sampler_mass"] <= 1.0


def test_bf16_is_the_default_on_a_bf16_gpu():
    assert AsyncGRPOConfig(output_dir="/tmp/asyncgrpo-gpu-config").bf16 is torch.cuda.is_bf16_supported()
