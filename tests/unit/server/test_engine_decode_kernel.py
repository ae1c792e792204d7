"""The Triton paged-decode kernel (interpreted on CPU) against a per-sequence softmax written here.

The kernel runs in a child process started with ``TRITON_INTERPRET=1``: the variable
must be set before triton is first imported, which this pytest process may already have done.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys

import pytest
import torch


def reference_decode(q, k_cache, v_cache, tables, lens):
    """softmax(q k^T / sqrt(d)) v per sequence and query head, over tokens gathered one by one (float64)."""
    B, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        slots = [(tables[b][t // bs], t % bs) for t in range(lens[b])]
        for h in range(Hq):
            kvh = h // group
            k = torch.stack([k_cache[blk, off, kvh] for blk, off in slots]).double()  # [L, D]
            v = torch.stack([v_cache[blk, off, kvh] for blk, off in slots]).double()
            w = torch.softmax(k @ q[b, h].double() / math.sqrt(D), dim=0)
            out[b, h] = w @ v
    return out


def _interpret(child: str, tmp_path, inputs: dict) -> torch.Tensor:
    """Run ``child`` (reads ``in.pt``, writes ``out.pt``) under the Triton interpreter; its output tensor."""
    torch.save(inputs, tmp_path / "in.pt")
    subprocess.run([sys.executable, "-c", child, str(tmp_path)], env={**os.environ, "TRITON_INTERPRET": "1"},
                   check=True, timeout=300)  # fmt: skip
    return torch.load(tmp_path / "out.pt")


CHILD = """
import sys, torch
from asyncgrpo.server.layers.decode_kernel import paged_decode
d = torch.load(sys.argv[1] + "/in.pt")
st = d["static"]
out = paged_decode(d["q"], d["k"], d["v"], st[:, 4:], st[:, 3], d["scale"], block_n=32)
torch.save(out, sys.argv[1] + "/out.pt")
"""


# bf16 is left to the GPU tests: the interpreter mishandles it
@pytest.mark.parametrize(
    "dtype,group,block_size", [(torch.float32, 2, 16), (torch.float32, 4, 8), (torch.float16, 1, 16)]
)
def test_triton_paged_decode_matches_reference(tmp_path, dtype, group, block_size):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    Hkv, D, num_blocks = 2, 32, 48
    lens = [1, 17, 70, 33]  # crosses block and BLOCK_N tile boundaries
    max_blocks = 10
    blocks = list(range(num_blocks))
    random.Random(1).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(max_blocks)] for _ in lens]
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    q = torch.randn(len(lens), Hkv * group, D, generator=gen).to(dtype)
    # the engine passes views of one int64 buffer, so use non-contiguous context lengths too
    static = torch.zeros(len(lens), 4 + max_blocks, dtype=torch.int64)
    static[:, 3] = torch.tensor(lens)
    static[:, 4:] = torch.tensor(tables)
    got = _interpret(CHILD, tmp_path, {"q": q, "k": k_cache, "v": v_cache, "static": static, "scale": D**-0.5})
    ref = reference_decode(q, k_cache, v_cache, tables, lens)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)


PREFILL_CHILD = """
import sys, torch
from asyncgrpo.server.layers.prefill_kernel import paged_prefill
d = torch.load(sys.argv[1] + "/in.pt")
st = d["static"]
out = paged_prefill(d["q"], d["k"], d["v"], st[:, 4:], st[:, 3], d["tiles"], d["scale"], block_n=32)
torch.save(out, sys.argv[1] + "/out.pt")
"""


@pytest.mark.parametrize("dtype,group,block_size", [(torch.float32, 2, 16), (torch.float32, 1, 8)])
def test_triton_paged_prefill_matches_reference(tmp_path, dtype, group, block_size):
    """Row-wise prefill tiles: each row attends causally to its own sequence's cache up to its position; rows
    outside every tile (graph padding) come out as zeros."""
    pytest.importorskip("triton")
    from asyncgrpo.server.layers.prefill_tiles import tile_rows

    gen = torch.Generator().manual_seed(0)
    Hkv, D, num_blocks, max_blocks = 2, 32, 48, 10
    bm = tile_rows(group)
    # sequence A: cached prefix of 5, then bm + 7 new rows (two tiles, the last partial); sequence B: 3 new rows
    a_pos = list(range(5, 5 + bm + 7))
    b_pos = [0, 1, 2]
    blocks = list(range(num_blocks))
    random.Random(2).shuffle(blocks)
    tables = [[blocks.pop() for _ in range(max_blocks)] for _ in range(2)]
    rows = [(0, p) for p in a_pos] + [(1, p) for p in b_pos] + [(None, 0)] * 4  # 4 padding rows
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    q = torch.randn(len(rows), Hkv * group, D, generator=gen).to(dtype)
    static = torch.zeros(len(rows), 4 + max_blocks, dtype=torch.int64)
    for r, (seq, p) in enumerate(rows):
        if seq is not None:
            static[r, 3] = p + 1
            static[r, 4:] = torch.tensor(tables[seq])
    n_a = len(a_pos)
    tiles = torch.tensor([[0, bm], [bm, n_a - bm], [n_a, 3], [0, 0], [0, 0]], dtype=torch.int64)
    inputs = {"q": q, "k": k_cache, "v": v_cache, "static": static, "tiles": tiles, "scale": D**-0.5}
    got = _interpret(PREFILL_CHILD, tmp_path, inputs)
    real = [r for r, (seq, _) in enumerate(rows) if seq is not None]
    ref = reference_decode(
        q[real], k_cache, v_cache, [tables[rows[r][0]] for r in real], [rows[r][1] + 1 for r in real]
    )
    torch.testing.assert_close(got[real].double(), ref, atol=1e-5, rtol=1e-5)
    assert got[len(real) :].abs().max() == 0


CHECKS_CHILD = """
import torch
from asyncgrpo.server.layers.attention import check_prefill_kernel, check_triton_decode
cpu = torch.device("cpu")
print(check_triton_decode(cpu, torch.float32, 2, 2, 32), check_prefill_kernel(cpu, torch.float32, 2, 2, 32))
"""


def test_start_up_checks_pass_for_working_kernels():
    """The engine's start-up checks (compile, compare with the torch reference) accept both kernels; under the
    interpreter on CPU, in fp32."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", CHECKS_CHILD], check=False, env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
