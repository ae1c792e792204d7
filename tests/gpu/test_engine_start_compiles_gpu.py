"""A cold start compiles each Triton kernel variant once, before the graphs: the start-up checks and the early
compile thread build the variants the decode and prefill graphs launch, and the sampler's variants of one
vocabulary share one combine program.

Each case runs in a child process with an empty Triton cache (``TRITON_CACHE_DIR``), where every compile leaves
one ``<name>.cubin`` file: the files are the count. Run on the GPU machine:
``python -m pytest -q -m gpu tests/gpu/test_engine_start_compiles_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgrpo.assets import tiny_model_dir

pytestmark = pytest.mark.gpu

CHILD = r"""
import json, os, sys, threading
from collections import Counter
from asyncgrpo.server.engine import runner
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, SamplingParams
from asyncgrpo.server.layers import sample_kernel

def cubins():
    return Counter(f[:-6] for _, _, fs in os.walk(os.environ["TRITON_CACHE_DIR"]) for f in fs if f.endswith(".cubin"))

seen = {}
capture = runner.ModelRunner.capture_graphs
def counted(self):
    seen["before_graphs"] = cubins()
    capture(self)
    seen["after_graphs"] = cubins()
runner.ModelRunner.capture_graphs = counted
eng = Engine(sys.argv[1], dtype="bfloat16", device="cuda", max_model_len=512, max_num_seqs=64, kv_cache_tokens=16384)
seen["ready"] = cubins()
eng.start()
done, outs = threading.Event(), {}
def cb(o):
    outs[o.request_id] = o
    if len(outs) == 12:
        done.set()
for i in range(12):  # prefill rows of several sizes, then decode batches shrinking from 12 to 1
    prompt = [(7 * i + j) % 200 + 3 for j in range(5 + 9 * i)]
    eng.submit(Request(f"r{i}", prompt, SamplingParams(max_tokens=4 + 3 * i, temperature=0.0 if i % 2 else 1.0,
                                                       ignore_eos=True, logprobs=2)), cb)
assert done.wait(240), "requests did not finish"
seen["after_generation"] = cubins()
seen["slice_sizes"] = sorted({sample_kernel.choose_slice(1 << i, eng.vocab_size, sample_kernel._sm_count(eng.device))
                              for i in range(13)})
eng.shutdown()
print("RESULT " + json.dumps(seen))
"""


def _cold_start(tmp_path: Path, arch: str, early: bool) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), ASYNCGRPO_EARLY_COMPILE="1" if early else "0")
    model = tiny_model_dir(arch, tmp_dir=tmp_path, hidden_size=256, intermediate_size=704, vocab_size=49152)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model)], check=False, env=env, capture_output=True, text=True,
                          timeout=400)  # fmt: skip
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    return json.loads(line[-1][7:])


@pytest.mark.parametrize(("arch", "early"), [("llama", True), ("qwen3", False)])
def test_a_cold_start_compiles_every_kernel_before_its_graphs(tmp_path, arch, early):
    seen = _cold_start(tmp_path, arch, early)
    assert seen["after_graphs"] == seen["before_graphs"], "capturing the graphs compiled a variant the checks had not"
    assert seen["after_generation"] == seen["ready"], "serving compiled a variant the start had not"
    ready = seen["ready"]
    assert ready["combine_kernel"] == 1, "the sampler's slice sizes of one vocabulary share one combine program"
    assert ready["slice_kernel"] == len(seen["slice_sizes"]), "the self-check compiled a slice variant of its own"
    assert ready["qkv_rope_kernel"] <= 2, ready  # with and without the K/V copy for prefill's attention
    others = {k: n for k, n in ready.items() if k not in ("slice_kernel", "combine_kernel", "qkv_rope_kernel")}
    assert {"_paged_decode_kernel", "add_rms_norm_kernel", "silu_mul_kernel"} <= set(others), ready
    assert set(others.values()) == {1}, f"a kernel compiled twice: {ready}"
