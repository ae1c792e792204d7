"""The start's shortcuts: the early Triton compile's guess of the model's sizes (against the loaded model), its CPU
guard, and the server's own bytecode folder where the environment turns bytecode off (a real interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.server import bytecode
from asyncgrpo.server.engine import early_compile
from asyncgrpo.server.models.decoder import DecoderLM, resolve_dtype
from asyncgrpo.server.models.hf import load_any_model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_the_guessed_sizes_are_those_of_the_loaded_model(arch, dtype):
    path = tiny_model_dir(arch)
    cuda = torch.device("cuda", 0)  # only its type is read: what the dtype resolves to on CUDA
    shapes = early_compile.guess_shapes(path, dtype, cuda)
    m = DecoderLM(load_any_model(path, "float32", "cpu"), 64)
    assert (shapes.num_heads, shapes.num_kv_heads, shapes.head_dim) == (m.num_heads, m.num_kv_heads, m.head_dim)
    assert shapes.vocab == m.vocab_size and shapes.qk_norm == (m.layers[0].q_norm is not None)
    assert (shapes.hidden, shapes.intermediate) == (
        m.hidden_size,
        m.intermediate_size,
    )  # the norms' and SwiGLU's widths
    assert shapes.dtype == resolve_dtype(dtype, m.hf_model.config, cuda)


def test_no_guess_for_a_model_the_native_path_does_not_run(tmp_path):
    assert early_compile.guess_shapes(tiny_model_dir("qwen3_moe"), "auto", torch.device("cpu")) is None
    assert early_compile.guess_shapes(tmp_path, "auto", torch.device("cpu")) is None  # no config.json
    assert early_compile.guess_shapes(torch.nn.Linear(2, 2), "auto", torch.device("cpu")) is None


def test_a_cpu_engine_starts_no_thread_and_asks_cuda_nothing(monkeypatch):
    def no_cuda(*a, **k):
        raise AssertionError("CUDA was asked on a CPU engine")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    assert early_compile.start_early_compile(tiny_model_dir("llama"), "auto", "cpu", False) is None
    monkeypatch.setenv("ASYNCGRPO_EARLY_COMPILE", "0")
    assert early_compile.start_early_compile(tiny_model_dir("llama"), "auto", "cuda", False) is None


SCRIPT = textwrap.dedent("""
    import sys
    from asyncgrpo.server.bytecode import keep_bytecode
    sys.path.insert(0, sys.argv[1])
    print(keep_bytecode(probe=sys.argv[2]))
    import probe_module
""")


@pytest.mark.parametrize("choice", [None, "0"])
def test_bytecode_goes_to_the_servers_folder_where_the_environment_turns_it_off(tmp_path, choice):
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe_module.py").write_text("X = 1\n")  # a module without bytecode, like torch on the H200 machine
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "ASYNCGRPO_CACHE": str(tmp_path / "cache")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    if choice is not None:
        env[bytecode.ENV] = choice
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(src), "probe_module"], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    written = sorted(tmp_path.rglob("probe_module*.pyc"))
    assert not (src / "__pycache__").exists()  # the sources' folder is left as it was
    if choice == "0":
        assert out.stdout.strip() == "None" and written == []
    else:
        assert out.stdout.strip() == str(tmp_path / "cache" / "pycache")
        assert len(written) == 1 and written[0].is_relative_to(tmp_path / "cache" / "pycache" / str(src).lstrip("/"))


def test_bytecode_is_left_alone_where_it_is_written_already_or_there(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode.keep_bytecode() is None
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # torch here came with its bytecode: a prefix would lose it
    assert bytecode.has_bytecode("torch") and bytecode.keep_bytecode() is None and sys.pycache_prefix is None
    assert not bytecode.has_bytecode("no_such_module_at_all")


def test_a_prefix_folder_set_already_is_written_to(tmp_path, monkeypatch):
    """The engine process starts with the API process's folder in its environment (and -B): it writes there too,
    whether torch's bytecode is there yet or not."""
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path))
    monkeypatch.delenv(bytecode.ENV, raising=False)
    assert bytecode.keep_bytecode() == str(tmp_path) and sys.dont_write_bytecode is False


def test_a_triton_cache_holding_every_kernel_looks_warm(tmp_path):
    """Triton's cache layout: one folder per compiled variant, the module named after its function."""
    assert not early_compile.triton_cache_looks_warm(str(tmp_path / "missing"))
    for i, name in enumerate(early_compile._KERNELS):
        assert not early_compile.triton_cache_looks_warm(str(tmp_path))  # one kernel still missing
        (tmp_path / f"key{i}").mkdir()
        (tmp_path / f"key{i}" / f"{name}.cubin").write_bytes(b"")
        (tmp_path / f"key{i}" / f"{name}.json").write_text("{}")
    assert early_compile.triton_cache_looks_warm(str(tmp_path))
