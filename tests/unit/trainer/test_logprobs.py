"""Chunked log-probs/entropy/top-N (trainer/logprobs.py) against a full-vocabulary materialisation."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from asyncgrpo.trainer.logprobs import selective_logprobs


def _reference(h, w, targets, temperature, extra, cand_mask):
    """Everything materialised: [N, V] logits, masked to candidate sets, log-softmax."""
    z = (h @ w.T) / temperature
    if cand_mask is not None:
        z = z.masked_fill(~cand_mask, float("-inf"))
    logp = z.log_softmax(-1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    ex = logp.gather(1, extra.clamp(min=0)).masked_fill(extra < 0, float("-inf"))
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return lp, ex, ent, logp


def _problem(seed=0, n=37, hid=16, vocab=50, k=4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=g)
    w = torch.randn(vocab, hid, generator=g) * 0.5
    targets = torch.randint(0, vocab, (n,), generator=g)
    extra = torch.randint(0, vocab, (n, k), generator=g)
    extra[::3, -1] = -1  # padding slots
    # candidate sets on every other token: the target plus 5 random ids
    cand_mask = torch.zeros(n, vocab, dtype=torch.bool)
    for i in range(0, n, 2):
        cand_mask[i, torch.randint(0, vocab, (5,), generator=g)] = True
        cand_mask[i, targets[i]] = True
        cand_mask[i, extra[i].clamp(min=0)] = True
    cand_mask[1::2] = True  # tokens without a set: full vocabulary
    pairs = torch.nonzero(cand_mask[::2].clone())
    pairs[:, 0] *= 2  # back to token indices of the even rows
    return h, w, targets, extra, cand_mask, pairs[torch.randperm(len(pairs), generator=g)]


@pytest.mark.parametrize("use_candidates", [False, True])
@pytest.mark.parametrize("chunk", [8, 37, 1000])
def test_values_and_gradients_match_full_materialisation(use_candidates, chunk):
    h, w, targets, extra, cand_mask, pairs = _problem()
    temperature = 0.7
    g = torch.Generator().manual_seed(1)
    a, b, c = torch.randn(len(h), generator=g), torch.randn(extra.shape, generator=g), torch.randn(len(h), generator=g)

    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = selective_logprobs(
        h1, w1, targets, temperature=temperature, chunk_size=chunk, extra_ids=extra,
        candidates=pairs if use_candidates else None, want_entropy=True, top_n=3,
    )  # fmt: skip
    valid = extra >= 0
    loss = (a * out.logprobs).sum() + (b * out.extra_logprobs)[valid].sum() + (c * out.entropy).sum()
    loss.backward()

    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ex, ent, logp = _reference(h2, w2, targets, temperature, extra, cand_mask if use_candidates else None)
    ((a * lp).sum() + (b * ex)[valid].sum() + (c * ent).sum()).backward()

    torch.testing.assert_close(out.logprobs, lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.extra_logprobs, ex, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-5)
    top_vals, top_idx = logp.topk(3, dim=-1)
    torch.testing.assert_close(out.top_logprobs, top_vals, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.top_ids, top_idx)


def test_frozen_head_gets_no_gradient_and_plain_call_returns_only_logprobs():
    h, w, targets, *_ = _problem(seed=3)
    h1 = h.clone().requires_grad_()
    out = selective_logprobs(h1, w, targets, chunk_size=5)
    assert out.extra_logprobs is None and out.entropy is None and out.top_ids is None
    out.logprobs.sum().backward()
    h2 = h.clone().requires_grad_()
    h2_lp = (h2 @ w.T).log_softmax(-1).gather(1, targets[:, None]).sum()
    h2_lp.backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    assert w.grad is None


def test_bf16_inputs_follow_the_head_dtype():
    h, w, targets, *_ = _problem(seed=4, n=20, hid=32, vocab=64)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    out = selective_logprobs(hb, wb, targets, chunk_size=6)
    out.logprobs.sum().backward()
    assert out.logprobs.dtype == torch.float32 and hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    ref = (hb.float() @ wb.float().T).log_softmax(-1).gather(1, targets[:, None])[:, 0]
    assert (out.logprobs - ref).abs().max() < 0.1  # bf16 logits vs fp32 logits of the same bf16 inputs


def test_bad_shapes_are_reported():
    h, w, targets, *_ = _problem()
    with pytest.raises(ValueError, match="targets"):
        selective_logprobs(h, w, targets[:-1])
    with pytest.raises(ValueError, match="temperature"):
        selective_logprobs(h, w, targets, temperature=0.0)


# Peak memory: each size runs in a fresh interpreter and reads the kernel's high-water mark of its resident
# memory (VmHWM), reset just before the call through /proc/self/clear_refs; the growth is the memory the call
# needed. (ru_maxrss would not do: Linux carries it over from the parent process.) A fixed mmap threshold
# makes glibc return freed large buffers to the OS, so RSS tracks live tensors instead of allocator caching.
_PROBE = """
import sys, torch
from asyncgrpo.trainer.logprobs import selective_logprobs

def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

n, vocab, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
h = torch.randn(n, 16, requires_grad=True); w = torch.randn(vocab, 16, requires_grad=True)
t = torch.randint(0, vocab, (n,)); ex = torch.randint(0, vocab, (n, 4))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the high-water mark to the current resident size
before = hwm()
if mode == "full":
    lp = (h @ w.T).log_softmax(-1); (lp.gather(1, t[:, None]).sum() + lp.gather(1, ex).sum()).backward()
else:
    o = selective_logprobs(h, w, t, extra_ids=ex, want_entropy=True, chunk_size=max(1, (1 << 18) // vocab))
    (o.logprobs.sum() + o.extra_logprobs.sum() + o.entropy.sum()).backward()
print(hwm() - before)
"""


def _peak_bytes(n: int, vocab: int, mode: str) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(n), str(vocab), mode], env=env, capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    return int(out.stdout.split()[-1])


def test_peak_memory_stays_bounded_as_tokens_times_vocab_grow():
    sizes = [(512, 4096), (2048, 8192), (8192, 16384)]  # [N, V] fp32 = 8 MB, 64 MB, 512 MB
    chunked = [_peak_bytes(n, v, "chunked") for n, v in sizes]
    full_mid = _peak_bytes(*sizes[1], "full")
    mb = 1 << 20
    assert full_mid >= 64 * mb  # the probe sees a materialised [N, V] tensor
    assert chunked[-1] < 48 * mb  # < 10 % of the 512 MB a materialisation would take
    assert chunked[-1] - chunked[0] < 16 * mb  # 64x more logits, about the same peak
