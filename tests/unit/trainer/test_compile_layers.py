"""Regional compile of the decoder layers (trainer/compile.py): same packed log-probs and gradients as the
per-sample unpacked HF forward, and a compile failure falls back to eager with one warning."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.compile import CompileSettings, compile_decoder_layers, decoder_layers
from tests.helpers.synthetic import random_tree_samples
from tests.unit.packing.test_packing_attention import COMMON, VOCAB, _packed, _reference


def _qwen3() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen3Config(head_dim=8, **COMMON)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


@pytest.mark.slow  # ~40 s on 2 shared cores: dynamo + AOT tracing of forward and backward
def test_compiled_layers_match_unpacked_reference():
    """Under gradient checkpointing (the default of real runs): the recompute runs the compiled layer too."""
    rng = np.random.default_rng(3)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=2)
    model = _qwen3()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    row = pack_samples(samples)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    torch._dynamo.reset()
    # aot_eager traces forward and backward the way inductor does, without a C compiler on 2 shared cores
    assert compile_decoder_layers(model, CompileSettings(backend="aot_eager")) == COMMON["num_hidden_layers"]
    assert compile_decoder_layers(model, CompileSettings(backend="aot_eager")) == 0  # idempotent
    lp, grads = _packed(model, row, weights)
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name
    assert all(layer._compiled_call_impl is not None for layer in decoder_layers(model))


def test_layers_are_traced_once_for_every_row_length():
    """One trace of forward and backward serves rows of new lengths. Without floats kept constant, RMSNorm's
    ``variance_epsilon`` turned symbolic under ``dynamic=True`` and dynamo traced the layer twice (2 AOT
    traces; 3.5 s of a 4.5 s warm-cache compile on an H200). The switch holds only inside the layers' calls."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON), dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    cases = []
    for seed, groups in ((3, 2), (4, 4)):  # references first: HF's own forward would trace the layers too
        rng = np.random.default_rng(seed)
        samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=groups)
        weights = torch.from_numpy(rng.standard_normal(pack_samples(samples).num_trained).astype(np.float32))
        cases.append((pack_samples(samples), weights, *_reference(model, samples, weights)))
    torch._dynamo.reset()
    counters.clear()
    before = torch._dynamo.config.specialize_float
    compile_decoder_layers(model, CompileSettings(backend="aot_eager"))
    assert cases[0][0].num_tokens != cases[1][0].num_tokens
    for row, weights, ref_lp, ref_grads in cases:
        lp, grads = _packed(model, row, weights)
        assert (lp - ref_lp).abs().max().item() <= 1e-4
        assert all((g - ref_grads[n]).abs().max().item() <= 1e-4 for n, g in grads.items())
    assert counters["aot_autograd"]["total"] == 1  # traced once, no restart, no recompile for the second length
    assert counters["stats"]["unique_graphs"] == 1
    assert torch._dynamo.config.specialize_float == before


def test_compile_failure_falls_back_to_eager_once(caplog):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded on purpose")

    rng = np.random.default_rng(5)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=2)
    row = pack_samples(samples)
    model = _qwen3().train()
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    torch._dynamo.reset()
    compile_decoder_layers(model, CompileSettings(backend=broken_backend))
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.compile"):
        lp, grads = _packed(model, row, weights)
        _packed(model, row, weights)
    warnings = [r for r in caplog.records if "running them eager" in r.getMessage()]
    assert len(warnings) == 1 and "backend exploded" in warnings[0].getMessage()
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(model))
    assert torch.equal(lp, ref_lp) or (lp - ref_lp).abs().max().item() <= 1e-4
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name


def test_model_without_layer_list_is_refused():
    with pytest.raises(ValueError, match="compile_decoder_layers=False"):
        compile_decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("device", "compile_layers", "peft", "started"),
    [("cuda", True, False, True), ("cpu", True, False, False), ("cuda", False, False, False),
     ("cuda", None, True, False)],
)  # fmt: skip
def test_compile_workers_start_early_only_where_the_layers_compile_on_cuda(monkeypatch, device, compile_layers, peft,
                                                                           started):  # fmt: skip
    """Inductor's Triton workers are asked for before the model loads only where layers compile with inductor on
    CUDA: on the CPU (C++ code, no pool), with compile off, or under an adapter they would only use cores."""
    from torch._inductor import async_compile

    from asyncgrpo.trainer.compile import start_compile_workers

    calls: list[int] = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    args = type("Args", (), {"device": device, "compile_decoder_layers": compile_layers, "world_size": 1})()
    assert start_compile_workers(args, peft=peft) is started
    assert calls == ([1] if started else [])


def test_compiling_the_layers_leaves_the_varlen_kernel_unimported(tmp_path):
    """Importing ``torch.nn.attention.varlen`` registers its custom ops: 1.2-1.8 s of a run's start (an H200 run,
    issue 41), which runs on FlexAttention never need. Its signature probe is answered where a varlen plan is built
    (before any layer runs it, so tracing never meets it), not when the layers are compiled. A fresh process: this
    one may have imported the kernel for other tests."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, LlamaConfig\n"
        "from asyncgrpo.trainer.compile import CompileSettings, compile_decoder_layers\n"
        "from asyncgrpo.packing import attention\n"
        f"cfg = LlamaConfig(**{COMMON!r})\n"
        "model = AutoModelForCausalLM.from_config(cfg)\n"
        "compile_decoder_layers(model, CompileSettings(backend='eager'))\n"
        "print('after compile', 'torch.nn.attention.varlen' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "after compile False" in done.stdout


def test_a_varlen_plan_answers_the_kernels_probe(monkeypatch):
    """The kernel's module is imported eagerly by the plan a varlen row runs with, before the layers trace it."""
    pytest.importorskip("torch.nn.attention.varlen")
    from asyncgrpo.packing import attention

    monkeypatch.setattr(attention, "_VARLEN_ATTN", None)
    row = pack_samples(random_tree_samples(np.random.default_rng(0), vocab_size=VOCAB, num_groups=2))
    plan = attention._varlen_plan(row, torch.device("cpu"))
    assert plan.backend == "varlen" and attention._VARLEN_ATTN is not None
