"""The engine's direct load (safetensors + config.json, no transformers) gives the model transformers' load gives.

The reference is transformers' own load of the same folder: the same parameter names in the same order, the same
values and dtypes, the same tied tensors, the same RoPE tables, and logits equal to the HF forward. Folders it does
not cover exactly must go to transformers (None).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.server.models.decoder import DecoderLM, _eps
from asyncgrpo.server.models.direct_load import load_direct
from asyncgrpo.server.models.hf import _load, load_any_model

ROOT = Path(__file__).resolve().parents[3]


def _no_part(name: str) -> None:
    pass


def _mistral_dir(tmp_path: Path) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=None)  # fmt: skip
    MistralForCausalLM(cfg).save_pretrained(tmp_path / "mistral")
    return tmp_path / "mistral"


CASES = [
    ("llama", {}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("qwen3", {"tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "rope_theta": 50000.0}),
]


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("case", [*range(len(CASES)), "mistral"])
def test_the_direct_load_is_transformers_load(case, dtype, tmp_path):
    folder = _mistral_dir(tmp_path) if case == "mistral" else tiny_model_dir(CASES[case][0], seed=2, **CASES[case][1])
    direct = load_direct(folder, dtype, "cpu", _no_part)
    ref = _load(str(folder), dtype, "cpu", _no_part)
    assert direct is not None
    got, want = direct.named_parameters(remove_duplicate=False), ref.named_parameters(remove_duplicate=False)
    got, want = list(got), list(want)
    assert [n for n, _ in got] == [n for n, _ in want]  # names and order: a weight update by name lands alike
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
        assert not a.requires_grad
    tied = ref.lm_head.weight is ref.model.embed_tokens.weight
    assert (direct.lm_head.weight is direct.model.embed_tokens.weight) == tied
    a, b = DecoderLM(direct, 128), DecoderLM(ref, 128)
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)
    norms = [(x.ln1, y.ln1) for x, y in zip(a.layers, b.layers, strict=True)] + [(a.norm, b.norm)]
    assert all(_eps(x) == _eps(y) for x, y in norms)


def test_the_directly_loaded_engine_matches_the_hf_forward():
    """Prefill + decode through the engine's runner on the direct load, against transformers' forward."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.server.engine.kv_cache import KVCache
    from asyncgrpo.server.engine.request import Request, SamplingParams
    from asyncgrpo.server.engine.runner import ModelRunner
    from asyncgrpo.server.engine.scheduler import Sequence

    folder = tiny_model_dir("qwen3", seed=3)
    model = DecoderLM(load_direct(folder, "float32", "cpu", _no_part), 64)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    kv = KVCache(len(model.layers), 32, 4, model.num_kv_heads, model.head_dim, model.dtype, model.device)
    runner = ModelRunner(model, kv, max_num_seqs=4, max_model_len=64, use_graphs=False)
    prompts = [[5, 17, 300, 9, 44], [7, 7, 1000]]
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(Request(f"r{i}", p, SamplingParams(max_tokens=4)), on_finish=lambda out: None)
        s.block_table = list(range(i * 16, i * 16 + 16))
        seqs.append(s)
    steps = [runner.prefill(seqs)]
    for t in (11, 12, 13):
        for s in seqs:
            s.token_ids.append(t)
        steps.append(runner.decode(seqs).clone())
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([s.token_ids])).logits[0]
        for k, got in enumerate(steps):
            torch.testing.assert_close(got[i], ref[len(prompts[i]) - 1 + k], atol=1e-4, rtol=1e-4)


def _edited(folder: Path, tmp_path: Path, **changes) -> Path:
    out = tmp_path / "edited"
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize(
    "changes",
    [
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            }
        },
        {"hidden_act": "gelu"},
        {"model_type": "gemma"},
        {"tie_word_embeddings": True},  # the checkpoint holds an lm_head a tied model would not read
        {"num_hidden_layers": 1},  # tensors of a second layer the config does not declare
    ],
)
def test_what_the_direct_load_does_not_cover_goes_to_transformers(changes, tmp_path):
    folder = _edited(tiny_model_dir("llama", seed=2), tmp_path, **changes)
    assert load_direct(folder, "auto", "cpu", _no_part) is None


def test_sharded_and_non_safetensors_checkpoints(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama", seed=2))
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="2MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    direct = load_direct(tmp_path / "sharded", "auto", "cpu", _no_part)
    assert direct is not None
    assert all(torch.equal(a, b) for a, b in zip(direct.parameters(), hf.parameters(), strict=True))
    (tmp_path / "bin").mkdir()  # a PyTorch pickle beside the config: not read here
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    assert load_direct(tmp_path / "bin", "auto", "cpu", _no_part) is None
    assert load_direct(hf, "auto", "cpu", _no_part) is None  # an instance: used as it is
    assert load_any_model(hf, "auto", "cpu") is hf


def test_an_engine_on_a_native_checkpoint_never_imports_transformers():
    """In a fresh interpreter, as the engine process runs: the load's parts name the safetensors read, and
    transformers stays out of ``sys.modules`` (the import was most of a warm server start on an H200)."""
    script = (
        "import sys; from asyncgrpo.server.engine.engine import Engine\n"
        f"e = Engine({str(tiny_model_dir('llama', seed=2))!r}, device='cpu', max_model_len=64, kv_cache_tokens=512,"
        " enforce_eager=True)\n"
        "print(sorted(e.start_parts_s['load']), 'transformers' in sys.modules)\n"
    )
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parts, imported = done.stdout.strip().rsplit(" ", 1)
    assert "safetensors" in parts and "transformers_import" not in parts
    assert imported == "False"
