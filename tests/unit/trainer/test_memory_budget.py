"""``activation_memory_budget``: compiled layers keep a share of their activations and recompute the rest, in place
of transformers' whole-layer checkpointing (trainer/compile.py)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.compile import CompileSettings, compile_decoder_layers, compile_for_training, decoder_layers
from tests.helpers.synthetic import random_tree_samples
from tests.unit.packing.test_packing_attention import COMMON, VOCAB, _packed, _reference


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON), dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def _min_cut_backend():
    """AOT autograd with the partitioner inductor uses (where the budget acts), and no code generation."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)


def _saved_bytes_and_grads(budget: float, row, weights):
    """Bytes the forward saves for the backward (each storage once) and the packed step's log-probs and grads."""
    model = _llama()
    torch._dynamo.reset()
    compile_decoder_layers(model, CompileSettings(backend=_min_cut_backend(), memory_budget=budget))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, grads = _packed(model, row, weights)
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(model))
    return sum(seen.values()), lp, grads


@pytest.mark.slow  # ~30 s on 2 shared cores: two AOT traces of forward and backward with the min-cut partitioner
def test_a_lower_budget_saves_less_and_gives_the_same_gradients():
    rng = np.random.default_rng(3)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=2)
    row = pack_samples(samples)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(_llama(), samples, weights)
    full, lp_full, grads_full = _saved_bytes_and_grads(1.0, row, weights)
    low, lp_low, grads_low = _saved_bytes_and_grads(0.0, row, weights)
    print(f"saved for the backward: budget 1 {full} bytes, budget 0 {low}")
    assert low < full, f"budget 0 saved {low} bytes, budget 1 {full}"
    for lp, grads in ((lp_full, grads_full), (lp_low, grads_low)):
        assert (lp - ref_lp).abs().max().item() <= 1e-4
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name


def _args(budget, compile_layers):
    return SimpleNamespace(activation_memory_budget=budget, compile_decoder_layers=compile_layers, device="cpu",
                           world_size=1, gradient_checkpointing=True, activation_checkpointing=True)  # fmt: skip


def test_the_budget_replaces_whole_layer_checkpointing_where_the_layers_compile():
    import torch._functorch.config as functorch_config

    model, args = _llama(), _args(0.3, True)
    torch._dynamo.reset()
    assert compile_for_training(model, args, peft=False, router_replay=None, backend="aot_eager") == 2
    assert args.gradient_checkpointing is False and args.activation_checkpointing is False
    call = decoder_layers(model)[0]._compiled_call_impl
    call.compiled = lambda: functorch_config.activation_memory_budget  # what a compile inside the call would read
    assert call() == 0.3
    assert functorch_config.activation_memory_budget == 1.0  # the process's other compiles keep torch's setting


def test_the_budget_is_ignored_with_a_warning_where_the_layers_run_eager(caplog):
    model, args = _llama(), _args(0.5, False)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.compile"):
        assert compile_for_training(model, args, peft=False, router_replay=None, backend="aot_eager") == 0
    assert args.gradient_checkpointing is True and args.activation_checkpointing is True
    assert any("activation_memory_budget=0.5 needs compiled decoder layers" in r.getMessage() for r in caplog.records)


def test_without_a_budget_checkpointing_stays_as_set():
    model, args = _llama(), _args(None, True)
    torch._dynamo.reset()
    compile_for_training(model, args, peft=False, router_replay=None, backend="aot_eager")
    assert args.gradient_checkpointing is True and args.activation_checkpointing is True
