"""The fused LM head's fp32 weight-gradient accumulator on CUDA: the chunk product added inside the GEMM (where this
torch can) against a float64 reference, and the bf16 head's gradients against full fp32 logits, with the in-GEMM
add on and forced off.

Run: ``pytest -s -q -m gpu tests/gpu/test_fused_head_gpu.py`` (one GPU, seconds).
"""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.trainer import fused_head
from asyncgrpo.trainer.fused_head import add_weight_grad, fused_logprobs_loss, weight_grad_in_gemm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


def test_the_chunk_product_lands_in_the_fp32_accumulator():
    g = torch.Generator(device=DEV).manual_seed(1)
    dz = (torch.randn(512, 4096, device=DEV, generator=g) * 1e-3).bfloat16()
    h = torch.randn(512, 1024, device=DEV, generator=g).bfloat16()
    acc = torch.randn(4096, 1024, device=DEV, generator=g)
    product = dz.double().T @ h.double()
    want = acc.double() + product
    in_gemm = weight_grad_in_gemm(DEV)
    add_weight_grad(acc, dz, h)
    err, scale = (acc.double() - want).abs().max().item(), product.abs().max().item()
    print(
        f"\nin-GEMM accumulation: {in_gemm} (torch {torch.__version__}); max error {err:.2e}, product up to {scale:.2e}"
    )
    # in the GEMM: fp32 sums of exact bf16 products; else the product is rounded to bf16 first (2^-9 relative)
    assert err <= (1e-5 if in_gemm else 4e-3) * scale + 1e-6


@pytest.mark.parametrize("in_gemm", [True, False])
def test_bf16_head_gradients_match_full_fp32_logits(monkeypatch, in_gemm):
    if in_gemm and not weight_grad_in_gemm(DEV):
        pytest.skip(f"torch {torch.__version__} has no fp32-output addmm into an fp32 tensor")
    monkeypatch.setitem(fused_head._IN_GEMM, DEV, in_gemm)
    g = torch.Generator(device=DEV).manual_seed(2)
    n, hid, vocab = 700, 256, 3000
    hidden = torch.randn(n, hid, device=DEV, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, hid, device=DEV, generator=g) * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (n,), device=DEV, generator=g)
    adv = torch.randn(n, device=DEV, generator=g)
    loss, _ = fused_logprobs_loss(
        hidden, weight, targets, lambda lo, hi, lp, ex: -(lp * adv[lo:hi]).sum() / n, chunk_size=64
    )  # chunks of 64: 11 accumulations
    loss.backward()
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    lp = torch.log_softmax(h32 @ w32.T, dim=-1).gather(1, targets[:, None])[:, 0]
    (-(lp * adv).sum() / n).backward()
    for name, got, ref in (("weight", weight.grad, w32.grad), ("hidden", hidden.grad, h32.grad)):
        rel = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"\n{name} gradient, in-GEMM {in_gemm}: worst error {rel:.2e} of the largest entry")
        assert rel <= 2e-2, name


def test_the_head_kernels_match_eager_and_never_sync_the_host():
    """The Triton row statistics and dense gradient against the eager arithmetic, at a vocabulary that is not a
    multiple of a block, with no host sync once warm (the compiled versions synced 4 times a chunk)."""
    from asyncgrpo.trainer import head_kernels

    g = torch.Generator(device=DEV).manual_seed(3)
    zb = (torch.randn(96, 151_936, device=DEV, generator=g) * 4).bfloat16()
    coef = torch.randn(96, device=DEV, generator=g)
    for temperature in (1.0, 0.7):
        s, _ = head_kernels.row_stats(zb, temperature, True)  # Triton's compile happens here
        head_kernels.dense_grad(zb, s, coef, temperature)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            s, mean = head_kernels.row_stats(zb, temperature, True)
            grad = head_kernels.dense_grad(zb, s, coef, temperature)
            s_only, none = head_kernels.row_stats(zb, temperature, False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref_s, ref_mean = head_kernels._row_stats(zb, temperature, True)
        assert torch.allclose(s, ref_s, rtol=1e-5, atol=1e-4) and torch.equal(s, s_only) and none.numel() == 0
        assert torch.allclose(mean, ref_mean, rtol=1e-4, atol=1e-3)
        ref_grad = head_kernels._dense_grad(zb, ref_s, coef, temperature).float()
        assert ((grad.float() - ref_grad).abs().max() / ref_grad.abs().max()).item() <= 1e-2
