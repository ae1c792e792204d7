"""Streaming weight sync: syncing a PEFT policy costs about one merged tensor of memory, not the model.

A child process (tests/helpers/sync_probe.py) holds a Llama (hidden 512, 4 layers) with a random LoRA
adapter on every linear layer and syncs it to a real embedded server over gloo exactly as the trainer
does (``WeightSender.update_model``): each merged weight ``W + scale·BA`` is a new tensor. Its RSS
high-water mark during the round, minus its RSS before, is the sender's peak extra memory; with small
tensors in their own mappings (``MALLOC_MMAP_THRESHOLD_``) freed tensors leave RSS at once. Building the
list of merged tensors first (the old sender) costs their sum, ~60 MiB here; streaming costs the tensor
being sent plus PEFT's temporary while merging it (plus one packed chunk). Afterwards the server must
generate exactly like the merged model, computed in this process by PEFT's own ``merge_and_unload``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.reference import (
    ALL_LINEAR,
    check_greedy,
    hf_greedy,
    hf_model,
    lora_model,
    server_greedy,
    write_tiny_llama,
)

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 50, 300, 14, 260, 341]
MIB = 1 << 20
SLACK = 4 * MIB  # interpreter, HTTP and gloo bookkeeping of one round
BUFFER = 1 * MIB  # packed chunk size: a chunk is at most this plus one tensor


@pytest.fixture(scope="module")
def setup(serve, tmp_path_factory):
    model_dir = write_tiny_llama(
        tmp_path_factory.mktemp("wide") / "llama", vocab_size=1024, hidden_size=512, intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    return serve(model_dir, "--max-model-len", "64"), model_dir


def _probe(url, model_dir, *, seed, packed):
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "tests.helpers.sync_probe", url, str(model_dir), "--seed", str(seed),
           "--buffer", str(BUFFER), *(["--packed"] if packed else [])]  # fmt: skip
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"sync probe failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_sync_holds_one_merged_tensor_and_the_server_gets_the_merged_model(setup, packed):
    server, model_dir = setup
    seed = 7 if packed else 5
    report = _probe(server.base_url, model_dir, seed=seed, packed=packed)
    largest = report["largest_bytes"]
    # the tensor being sent + PEFT's temporary (B@A before scaling) + one packed chunk (<= buffer + one tensor)
    bound = 2 * largest + (BUFFER + largest if packed else 0) + SLACK
    assert report["merged_count"] == 28 and report["merged_bytes"] >= 3 * bound  # the model dwarfs the bound
    assert report["peak_extra_bytes"] <= bound, report

    result, version = server_greedy(server.base_url, PROMPT, max_tokens=6)
    assert version == "measured"
    merged = lora_model(hf_model(model_dir), seed=seed, rank=8, targets=ALL_LINEAR).merge_and_unload().eval()
    check_greedy(merged, result, prompt=PROMPT)
    assert result.token_ids != hf_greedy(hf_model(model_dir), PROMPT, 6)[0]  # the sync changed the server's model
