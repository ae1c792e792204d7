"""What the server gets after a step: names, metadata up front, merged PEFT weights, FSDP2 gathers.

The reference for a PEFT policy is PEFT's own ``merge_and_unload()`` of an identical copy; for a
sharded policy, the same model built unsharded. Metadata must describe exactly the tensors that
``policy_weights`` yields later (the update is announced before anything is gathered).
"""

from __future__ import annotations

import copy
import datetime
import faulthandler
import gc
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from asyncgrpo.process_exit import exit_without_teardown
from asyncgrpo.server.launcher import free_port
from asyncgrpo.weights.collectives import TensorMeta
from asyncgrpo.weights.policy import join_policy_gathers, policy_weight_metadata, policy_weights
from tests.helpers.reference import lora_model

RANKS_TIMEOUT_S = 120.0  # about 10 s on an idle 2-core machine


def _tiny_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _peft_policy(seed: int) -> torch.nn.Module:
    """LoRA on q/v/down plus a trained copy of the LM head (modules_to_save), all moved off their init."""
    model = lora_model(_tiny_llama(seed), seed=seed, modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    return model


def _collect(model: torch.nn.Module) -> tuple[list[TensorMeta], dict[str, torch.Tensor]]:
    metas = policy_weight_metadata(model)
    got = {}
    for name, t in policy_weights(model):
        got[name] = t.clone()
    return metas, got


def _assert_describes(metas: list[TensorMeta], got: dict[str, torch.Tensor]) -> None:
    assert [m.name for m in metas] == list(got)
    for m in metas:
        assert (m.dtype, m.shape) == (got[m.name].dtype, tuple(got[m.name].shape)), m.name


def test_plain_model_sends_its_parameters_as_they_are():
    model = _tiny_llama()
    metas, got = _collect(model)
    _assert_describes(metas, got)
    assert list(got) == [n for n, _ in model.named_parameters()]
    assert all(torch.equal(got[n], p) for n, p in model.named_parameters())


def test_peft_policy_sends_the_merged_model_under_base_names():
    model = _peft_policy(seed=3)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    metas, got = _collect(model)
    _assert_describes(metas, got)
    assert list(got) == list(reference)  # HF names: no lora_*, base_layer, original_module or adapter segments
    for name, t in got.items():
        assert torch.equal(t, reference[name]), name  # W + scale·BA exactly as PEFT merges it
    base = _tiny_llama(seed=3).state_dict()
    assert not torch.equal(got["lm_head.weight"], base["lm_head.weight"])  # the trained copy, not the original
    assert not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"]
    )


def _fsdp_main(rank: int, port: int, path: str) -> None:
    """One rank: shard a plain and a PEFT policy with FSDP2; rank 0 collects, rank 1 joins the gathers."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack, not just "terminate"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A collective that never completes fails after a minute, not at the suite's 10-minute test timeout (once, on
    # the shared 2-core machine, both ranks sat in the same all-gather for minutes).
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    out = {}
    try:
        for kind, model in (("plain", _tiny_llama(seed=5)), ("peft", _peft_policy(seed=5))):
            for layer in model.get_decoder().layers:
                fully_shard(layer)
            fully_shard(model)
            if rank == 0:
                metas, got = _collect(model)
                rows = {
                    n: p.to_local().shape[0] for n, p in model.named_parameters() if n.endswith("embed_tokens.weight")
                }
                out[kind] = {"metas": metas, "tensors": got, "embed_local_rows": list(rows.values())}
            else:
                join_policy_gathers(model)
        # The sharded models hold the group through their device mesh: they go while the interpreter is whole, and
        # both ranks have finished every collective before either leaves.
        del model
        gc.collect()
        dist.barrier()
    finally:
        # Rank 0 hosts the rendezvous store: it leaves last, or rank 1's teardown may still poll the store after
        # it closed and abort ("terminate called without an active exception", seen once on a loaded machine).
        done = Path(path + ".rank1-left")
        if rank == 1:
            dist.destroy_process_group()
            done.touch()
        else:
            deadline = time.monotonic() + 90
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            dist.destroy_process_group()
    if rank == 0:
        torch.save(out, path)
    # gloo's worker threads can still abort the interpreter's teardown (CI saw rank 1 die of SIGABRT, "terminate
    # called without an active exception", after the ordered leave above): the work is saved, so the rank ends as
    # ``python -m asyncgrpo`` does, without that teardown.
    exit_without_teardown(0)


def test_fsdp2_policy_announces_global_shapes_and_gathers_one_tensor_at_a_time(tmp_path):
    """Two gloo ranks shard the policy with FSDP2; rank 0's metadata (taken before any gather) and tensors
    equal the unsharded model's (PEFT: merged by PEFT), while rank 1 only joins the gathers."""
    path = str(tmp_path / "rank0.pt")
    ranks = mp.start_processes(_fsdp_main, args=(free_port(), path), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    while not ranks.join(timeout=1.0):  # raises as soon as a rank fails
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the two FSDP2 ranks were still running after {RANKS_TIMEOUT_S:.0f} s (a stuck collective?)")
    out = torch.load(path, weights_only=False)
    references = {
        "plain": _tiny_llama(seed=5).state_dict(),
        "peft": _peft_policy(seed=5).merge_and_unload().state_dict(),
    }
    for kind, reference in references.items():
        _assert_describes(out[kind]["metas"], out[kind]["tensors"])
        assert list(out[kind]["tensors"]) == list(reference), kind
        for name, t in out[kind]["tensors"].items():
            assert torch.allclose(t, reference[name], rtol=0, atol=1e-6), (kind, name)
        assert out[kind]["embed_local_rows"] == [48]  # rank 0 held half the embedding: the policy was sharded
