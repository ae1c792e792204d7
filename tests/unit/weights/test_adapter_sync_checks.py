"""Adapter sync pieces (SPEC T6): the start-up limits and the adapter files the trainer writes.

The written directory is checked against PEFT's own loader and the embedded server's reader; the whole round
trip through a server process is ``tests/integration/test_lora_sync.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncgrpo.assets import tiny_model
from asyncgrpo.server.engine.lora import read_adapter
from asyncgrpo.weights.lora_sync import adapter_rank, adapter_state, check_adapter_server, write_adapter
from tests.helpers.reference import lora_model


def test_limits_name_the_flag_and_value_to_restart_with():
    check_adapter_server(8, 2, max_lora_rank=8, max_loras=4, other_adapters=[])  # exactly enough: no error
    with pytest.raises(ValueError) as info:
        check_adapter_server(9, 2, max_lora_rank=8, max_loras=3, other_adapters=[])
    msg = str(info.value)
    assert "--max-lora-rank 16" in msg  # the next rank vLLM accepts above 9
    assert "--max-loras 4" in msg and "max_staleness + 1 = 3" in msg
    with pytest.raises(ValueError, match="--max-loras 5") as info:
        check_adapter_server(4, 2, max_lora_rank=8, max_loras=4, other_adapters=["someone-elses"])
    assert "someone-elses" in str(info.value) and "--max-lora-rank" not in str(info.value)


def test_written_adapter_loads_in_peft_and_in_the_embedded_server(tmp_path):
    base = tiny_model("llama")
    reference = copy.deepcopy(base)
    model = lora_model(base, seed=3, rank=4, targets=("q_proj", "v_proj", "down_proj"))  # random A and B
    assert adapter_rank(model) == 4
    path = tmp_path / "asyncgrpo-lora-step-7"
    write_adapter(model, adapter_state(model), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no staging directory left behind

    attn, mlp = reference.model.layers[0].self_attn, reference.model.layers[0].mlp
    shapes = {m: tuple(getattr(attn if hasattr(attn, m) else mlp, m).weight.shape)
              for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}  # fmt: skip
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(reference, str(path)).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model.eval()(ids).logits, atol=1e-6)
    adapter = read_adapter("step-7", str(path), max_rank=8, layer_shapes=shapes, num_layers=2,
                           dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    assert adapter.rank == 4 and len(adapter.weights) == 2 * 3  # 2 layers x 3 adapted projections
