"""LoRA through the engine equals the PEFT-merged model; base rows in the same batch stay base."""

from __future__ import annotations

import pytest

from asyncgrpo.assets import tiny_model
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request
from tests.helpers.reference import ALL_LINEAR, hf_greedy, make_lora_adapter
from tests.unit.server.test_engine_batching import Collector, greedy

TARGETS = list(ALL_LINEAR)
PROMPT = [10, 20, 30, 40, 50, 60]


@pytest.mark.parametrize("arch,rslora", [("qwen3", False), ("llama", True)])
def test_lora_rows_match_merged_model_and_base_rows_stay_base(arch, rslora, tmp_path):
    base = tiny_model(arch, seed=0)
    merged = make_lora_adapter(base, tmp_path / "a", seed=0, alpha=16, rslora=rslora, targets=TARGETS)
    eng = Engine(tiny_model(arch, seed=0), max_model_len=64, kv_cache_tokens=512, enable_lora=True, max_lora_rank=8)
    eng.load_lora("a", str(tmp_path / "a"))
    assert eng.lora_names == ["a"]
    eng.start()
    try:
        col = Collector()
        eng.submit(Request("lora", PROMPT, greedy(10), lora_name="a"), col)
        eng.submit(Request("base", PROMPT, greedy(10)), col)
        outs = col.wait(["lora", "base"])
    finally:
        eng.shutdown()
    lora_tokens, lora_lps = hf_greedy(merged, PROMPT, 10)
    base_tokens, _ = hf_greedy(base, PROMPT, 10)
    assert lora_tokens != base_tokens  # the adapter matters
    assert outs["lora"].token_ids == lora_tokens
    assert outs["lora"].logprobs == pytest.approx(lora_lps, abs=1e-4)
    assert outs["base"].token_ids == base_tokens


def test_lora_registry_errors(tmp_path):
    base = tiny_model("qwen3", seed=0)
    make_lora_adapter(base, tmp_path / "ok", seed=0, rank=4, targets=TARGETS)
    make_lora_adapter(base, tmp_path / "big", seed=0, rank=16, targets=TARGETS)
    make_lora_adapter(base, tmp_path / "head", seed=0, targets=["q_proj", "lm_head"])
    eng = Engine(tiny_model("qwen3", seed=0), max_model_len=32, kv_cache_tokens=256, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="lm_head"):
        eng.load_lora("head", str(tmp_path / "head"))
    with pytest.raises(ValueError, match="max_lora_rank"):
        eng.load_lora("big", str(tmp_path / "big"))
    eng.load_lora("ok", str(tmp_path / "ok"))
    with pytest.raises(ValueError, match="already loaded"):
        eng.load_lora("ok", str(tmp_path / "ok"))
    with pytest.raises(ValueError, match="max_loras"):
        eng.load_lora("ok2", str(tmp_path / "ok"))
    eng.unload_lora("ok")
    assert eng.lora_names == []
    with pytest.raises(KeyError):
        eng.unload_lora("ok")
    plain = Engine(tiny_model("qwen3", seed=0), max_model_len=32, kv_cache_tokens=256)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.load_lora("ok", str(tmp_path / "ok"))
