"""The split-vocabulary sampling kernels (interpreted on CPU) against a torch reference computed here.

Greedy rows: argmax with the first index on ties; seeded rows: the same token as
the race over ``hashed_exponential`` noise (the kernel recomputes that hash);
unseeded rows: the race over the same hash keyed by the row's random key; all
rows: the processed log-prob of the chosen token, the log-sum-exp of logits / T
and the top-N as a stable descending sort gives it (ties: lower token id first).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from asyncgrpo.server.engine.sampler import _mix32, _token_hash, hashed_exponential

CHILD = """
import sys, torch
from asyncgrpo.server.layers import sample_kernel
d = torch.load(sys.argv[1] + "/in.pt")
out = {}
for name, (top_n, slice_size, rows) in d["runs"].items():
    tok, packed, lse = sample_kernel.fused_sample(d["logits"][rows], d["temps"][rows], d["meta"][:, rows],
                                                  d["rand"][rows], top_n=top_n, slice_size=slice_size)
    out[name] = {"tok": tok, "packed": packed, "lse": lse, "k": top_n}
torch.save(out, sys.argv[1] + "/out.pt")
"""
NEG_INF = float("-inf")


def _run_child(tmp_path, code: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def _race(x: torch.Tensor, noise: torch.Tensor) -> int:
    """argmax of x - log E over the live tokens of one row, first index on ties (float32, as both paths)."""
    score = torch.where(x == NEG_INF, NEG_INF, x - noise.clamp(min=torch.finfo(torch.float32).tiny).log())
    return int(score.argmax())


def _keyed_noise(key: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise of a MODE_RANDOM_KEY row: the seeded hash with the row key given directly."""
    bits = _mix32(torch.tensor(key & 0xFFFFFFFF) ^ _token_hash(vocab, torch.device("cpu")))
    return (((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).log().neg()


def test_kernel_matches_a_torch_reference(tmp_path):
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    B, V = 7, 5000  # slices of 1024: five, the last one partial (904 columns); of 256: 20, the last 136 wide
    logits = torch.randn(B, V, generator=g) * 3
    logits[0, [10, 11, 2000, 4999]] = 20.0  # ties inside a slice and across slices: lowest id first everywhere
    logits[1, [4500, 4000]] = 40.0  # a greedy tie in a later slice: 4000 wins
    logits[4, :100] = NEG_INF  # masked tokens never win the race ...
    logits[4, 1024:2048] = NEG_INF  # ... and a slice of only -inf adds nothing to the log-sum-exp
    logits[5] = NEG_INF
    logits[5, [7, 3000, 4998]] = torch.tensor([0.5, 0.2, 0.1])  # three live tokens: top-8 ends with -inf ids
    logits[6, 3000:3010] = 20.0  # ten equal values for N = 8 and N = 20
    temps = torch.tensor([1.0, 1.0, 0.7, 1.3, 1.0, 2.0, 0.9])
    seeds, positions = [0, 0, 123, 2**40 + 5, 77, 9, 0], [0, 0, 3, 11, 0, 250, 0]
    modes = [0, 0, 2, 2, 2, 1, 0]  # greedy, greedy, seeded x3, generator key, greedy
    meta = torch.tensor([[s & 0xFFFFFFFF for s in seeds], [(s >> 32) & 0xFFFFFFFF for s in seeds], positions, modes])
    rand = torch.tensor([0, 0, 0, 0, 0, 3_000_000_000, 0])
    every = list(range(B))  # (top_n, slice size, rows): 20, 10, 5 and 5 slices a row
    runs = {"n8": (8, 256, every), "n1": (1, 512, every), "n20": (20, 1024, every), "none": (0, None, [0, 4, 5])}
    torch.save({"logits": logits, "temps": temps, "meta": meta, "rand": rand, "runs": runs}, tmp_path / "in.pt")
    _run_child(tmp_path, CHILD)
    out = torch.load(tmp_path / "out.pt")

    x = logits / temps[:, None]  # float32, as the kernel divides
    lse = torch.logsumexp(x.double(), dim=1)
    seeded = [2, 3, 4]
    noise = hashed_exponential([seeds[i] for i in seeded], [positions[i] for i in seeded], V, torch.device("cpu"))
    expected = [int(x[i].argmax()) for i in (0, 1)]
    expected += [_race(x[i], noise[j]) for j, i in enumerate(seeded)]
    expected += [_race(x[5], _keyed_noise(3_000_000_000, V)), int(x[6].argmax())]
    assert expected[:2] == [10, 4000] and expected[6] == 3000 and expected[5] in (7, 3000, 4998)
    assert expected[4] >= 100
    vals, ids = x.sort(dim=1, descending=True, stable=True)  # reference top-N: ties by lower id
    assert ids[0, :4].tolist() == [10, 11, 2000, 4999]
    for name, res in out.items():
        r = runs[name][2]
        n, k = len(r), res["k"]
        assert res["tok"].tolist() == [expected[i] for i in r], name
        torch.testing.assert_close(res["lse"].double(), lse[r], atol=1e-4, rtol=0, msg=name)
        chosen = x[r].double().gather(1, res["tok"][:, None]).squeeze(1) - lse[r]
        assert res["packed"][:n].tolist() == [expected[i] for i in r]
        torch.testing.assert_close(res["packed"][n : 2 * n], chosen, atol=1e-4, rtol=0, msg=name)
        assert res["packed"].numel() == 2 * n + 2 * n * k
        if k:
            top_ids = res["packed"][2 * n : 2 * n + n * k].view(n, k)
            top_vals = res["packed"][2 * n + n * k :].view(n, k)
            assert top_ids.long().tolist() == ids[r, :k].tolist(), name
            ref_vals = vals[r, :k].double() - lse[r, None]
            torch.testing.assert_close(top_vals, ref_vals, atol=1e-4, rtol=0, msg=name)


def test_slice_choice_fills_the_gpu_and_bounds_the_slices():
    pytest.importorskip("triton")
    from asyncgrpo.server.layers.sample_kernel import MAX_SLICES, choose_slice, fused_sample

    assert choose_slice(256, 151936, 132) == 4096 and choose_slice(8, 151936, 132) == 4096  # 8 x 38 >= 264
    assert choose_slice(4, 151936, 132) == 2048 and choose_slice(1, 151936, 132) == 1024
    assert -(-2_000_000 // choose_slice(1, 2_000_000, 132)) <= MAX_SLICES
    with pytest.raises(ValueError, match="torch.topk"):
        fused_sample(torch.zeros(1, 100), torch.ones(1), torch.zeros(4, 1, dtype=torch.long), torch.zeros(1), 33)


SAMPLER_CHILD = """
import sys, torch
from asyncgrpo.server.engine.request import SamplingParams
from asyncgrpo.server.engine.sampler import Sampler, SamplerRow
logits = torch.load(sys.argv[1] + "/logits.pt")
batches = [
    [SamplingParams(max_tokens=4, temperature=0.0, logprobs=3),
     SamplingParams(max_tokens=4, temperature=0.8, seed=5, logprobs=2),
     SamplingParams(max_tokens=4, temperature=1.0, seed=6),
     SamplingParams(max_tokens=4, temperature=1.2, seed=2**33 + 1, logprobs=0),
     SamplingParams(max_tokens=4, temperature=0.7, seed=8, logprobs=20)],
    [SamplingParams(max_tokens=4, temperature=0.0, logprobs=40),  # above the kernel's top-N: torch.topk
     SamplingParams(max_tokens=4, temperature=1.1, seed=3),
     SamplingParams(max_tokens=4, temperature=0.9, seed=4, logprobs=1),
     SamplingParams(max_tokens=4, temperature=0.0),
     SamplingParams(max_tokens=4, temperature=1.0, seed=9, logprobs=8)],
]
out = []
for params in batches:
    rows = [SamplerRow(params=p, num_output=k) for k, p in enumerate(params)]
    res = {}
    for fused in (True, False):
        s = Sampler(torch.device("cpu"), seed=0)
        s.use_kernel = fused
        r = s(logits, rows)
        res[fused] = (r.token_ids, r.logprobs, r.top_logprobs, r.masks)
    out.append(res)
torch.save(out, sys.argv[1] + "/out.pt")
"""


def test_sampler_fast_path_equals_the_torch_path(tmp_path):
    """The whole fast path (kernels, top-N in the kernel or by torch.topk above its maximum, one packed copy)
    against the torch path on greedy and seeded rows, with each row's own top-N contract."""
    pytest.importorskip("triton")
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(1)) * 2
    torch.save(logits, tmp_path / "logits.pt")
    _run_child(tmp_path, SAMPLER_CHILD)
    for out in torch.load(tmp_path / "out.pt", weights_only=False):
        (tok, lp, top, masks), (tok_ref, lp_ref, top_ref, masks_ref) = out[True], out[False]
        assert tok == tok_ref and masks == masks_ref == [None] * 5
        assert lp == pytest.approx(lp_ref, abs=1e-4)
        assert [None if t is None else len(t) for t in top] == [None if t is None else len(t) for t in top_ref]
        for t, ref in zip(top, top_ref):
            if t:
                assert [i for i, _ in t] == [i for i, _ in ref]
                assert [v for _, v in t] == pytest.approx([v for _, v in ref], abs=1e-4)
    first, second = (o[True][2] for o in torch.load(tmp_path / "out.pt", weights_only=False))
    assert [None if t is None else len(t) for t in first] == [3, 2, None, 0, 20]
    assert [None if t is None else len(t) for t in second] == [40, None, 1, None, 8]
