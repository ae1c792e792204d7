"""The split-vocabulary sampling kernels on CUDA at the real vocabulary, against the torch path and a reference.

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_sample_kernel_gpu.py``.
Greedy and seeded rows must pick the very token of the torch path (the kernel
divides by T with IEEE rounding and takes libdevice's ``logf``, as torch does; a
failure prints the gap of the two tokens' race scores). bf16 logits of a 152 k
vocabulary tie often inside a row's top-8, so the top-N ids are checked against
a stable descending sort (ties: lower id first, the kernel's order);
``torch.topk`` orders ties as it likes, so against the torch path only the
values are compared position by position.
"""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.server.engine.request import SamplingParams
from asyncgrpo.server.engine.sampler import Sampler, SamplerRow, hashed_exponential
from asyncgrpo.server.layers import sample_kernel

pytestmark = pytest.mark.gpu
V = 151936
KINDS = [  # (greedy, seeded, logprobs)
    (True, False, 8),
    (False, True, None),
    (False, True, 20),
    (False, False, 8),
]


def _params(i: int, kind: int) -> SamplingParams:
    greedy, seeded, logprobs = KINDS[kind]
    temp = 0.0 if greedy else 0.5 + (i % 16) / 16
    return SamplingParams(max_tokens=8, temperature=temp, seed=i * 7919 if seeded else None, logprobs=logprobs)


def _race_scores(x: torch.Tensor, row: SamplerRow) -> torch.Tensor:
    """The torch path's race scores of one seeded row, in float64 (a near-tie shows as a gap near zero)."""
    noise = hashed_exponential([row.params.seed], [row.num_output], x.shape[0], x.device)[0].double()
    return (x.double() - noise.clamp(min=torch.finfo(torch.float32).tiny).log()).cpu()


@pytest.mark.parametrize("batch", [1, 8, 256])
def test_split_kernel_sampler_matches_the_torch_path_on_cuda(batch):
    g = torch.Generator(device="cuda").manual_seed(batch)
    logits = (torch.randn(batch, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    logits[:, -40:] = float("-inf")  # padding columns of a real vocabulary: never sampled, never in a top-N
    kinds = [(i + 2) % 4 for i in range(batch)]  # batch 1: one seeded row with top-20
    rows = [SamplerRow(params=_params(i, k), num_output=i % 5) for i, k in enumerate(kinds)]
    fast, slow = Sampler(torch.device("cuda")), Sampler(torch.device("cuda"))
    slow.use_kernel = False
    assert fast.use_kernel, "the Triton sampling kernel failed its self-check (see the log)"
    a, b = fast(logits, rows), slow(logits, rows)

    x = logits.float() / torch.tensor([r.params.temperature or 1.0 for r in rows], device="cuda")[:, None]
    ref_lp = (x.double() - torch.logsumexp(x.double(), dim=1, keepdim=True)).cpu()
    ref_vals, ref_ids = ref_lp.sort(dim=1, descending=True, stable=True)
    for i, (row, k) in enumerate(zip(rows, kinds)):
        greedy, seeded, n = KINDS[k]
        tok = a.token_ids[i]
        assert 0 <= tok < V - 40, f"row {i}: sampled a masked or out-of-range token {tok}"
        if greedy:
            assert tok == b.token_ids[i], f"greedy row {i}: kernel {tok}, torch {b.token_ids[i]}"
        elif seeded and tok != b.token_ids[i]:  # same noise, IEEE division and libdevice log: must not happen
            score = _race_scores(x[i], row)
            gap = (score[tok] - score[b.token_ids[i]]).item()
            pytest.fail(f"seeded row {i}: kernel {tok}, torch {b.token_ids[i]} (torch race scores differ by {gap:.3g})")
        assert a.logprobs[i] == pytest.approx(ref_lp[i, tok].item(), abs=1e-3)
        if n is None:
            assert a.top_logprobs[i] is None and b.top_logprobs[i] is None
            continue
        ids, vals = [t for t, _ in a.top_logprobs[i]], [v for _, v in a.top_logprobs[i]]
        assert ids == ref_ids[i, :n].tolist(), f"row {i}: top-{n} ids not in descending, lower-id-first order"
        assert vals == pytest.approx(ref_vals[i, :n].tolist(), abs=1e-3)
        assert vals == pytest.approx([v for _, v in b.top_logprobs[i]], abs=1e-3)


def test_top_n_above_the_kernel_maximum_uses_torch_topk_on_cuda():
    n = sample_kernel.MAX_TOP_N + 8
    logits = (torch.randn(8, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)) * 3).half()
    rows = [SamplerRow(params=SamplingParams(max_tokens=8, temperature=0.8, seed=i, logprobs=n if i % 2 else 3),
                       num_output=i) for i in range(8)]  # fmt: skip
    out = Sampler(torch.device("cuda"))(logits, rows)
    x = logits.double() / 0.8
    ref_lp = (x - torch.logsumexp(x, dim=1, keepdim=True)).cpu()
    for i, top in enumerate(out.top_logprobs):
        assert top is not None and len(top) == (n if i % 2 else 3)
        assert [v for _, v in top] == pytest.approx(ref_lp[i].topk(len(top)).values.tolist(), abs=1e-3)
        assert [v for _, v in top] == pytest.approx([ref_lp[i, t].item() for t, _ in top], abs=1e-3)
