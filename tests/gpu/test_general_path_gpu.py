"""The engine's general model path on CUDA: a DeltaNet hybrid (Qwen3.5 text), Qwen3-MoE and a Qwen3-VL checkpoint
(text only) generate like their own HF forward, before and after an in-place weight update.

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_general_path_gpu.py`` (no assets needed).
"""

from __future__ import annotations

import threading

import pytest
import torch

from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, RequestOutput, SamplingParams

pytestmark = pytest.mark.gpu

VOCAB = 512
BASE = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "eos_token_id": 2}  # fmt: skip
PROMPTS = [[1, 5, 9, 200, 31], [7] * 20, [300, 301, 302]]


def _model(arch: str) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if arch == "qwen3_5":
        if not hasattr(tf, "Qwen3_5TextConfig"):
            pytest.skip(f"transformers {tf.__version__} has no Qwen3.5")
        types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
        cfg = tf.Qwen3_5TextConfig(**BASE, layer_types=types, linear_key_head_dim=32, linear_value_head_dim=32,
                                   linear_num_key_heads=2, linear_num_value_heads=4)  # fmt: skip
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**BASE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    text = dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
              "out_hidden_size": 128, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}  # fmt: skip
    cfg = tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return tf.AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)


def _generate(eng: Engine, n: int = 12) -> list[RequestOutput]:
    outs: dict[str, RequestOutput] = {}
    done = threading.Event()

    def cb(o: RequestOutput) -> None:
        outs[o.request_id] = o
        if len(outs) == len(PROMPTS):
            done.set()

    for i, p in enumerate(PROMPTS):
        eng.submit(Request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)), cb)
    assert done.wait(120), "requests did not finish"
    return [outs[f"r{i}"] for i in range(len(PROMPTS))]


@torch.no_grad()
def _check(model: torch.nn.Module, outs: list[RequestOutput], tol: float = 2e-3) -> None:
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt + out.token_ids[:-1]], device="cuda")
        ref = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 :].double(), -1)
        assert out.token_ids == ref.argmax(-1).tolist()
        got = torch.tensor(out.logprobs, dtype=torch.float64, device="cuda")
        assert (got - ref.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]).abs().max() <= tol


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_moe", "qwen3_vl"])
def test_general_path_on_cuda_matches_hf_and_loads_weights(arch):
    model = _model(arch).cuda().eval()
    eng = Engine(model, dtype="float32", device="cuda", max_model_len=128, max_num_seqs=4)
    assert eng.general_path and eng.decode_backend == "hf-general"
    eng.start()
    try:
        _check(model, _generate(eng))
        g = torch.Generator(device="cuda").manual_seed(1)
        # new weights by name (what a sync sends: the text model only for the VLM); the engine shares the
        # instance's parameters, so copy into fresh tensors made from them
        new = [(n, p + 0.05 * torch.randn(p.shape, generator=g, device="cuda")) for n, p in model.named_parameters()
               if not n.startswith("model.visual.")]  # fmt: skip
        eng.run_between_steps(lambda: eng.load_weights(new), timeout=60)
        _check(model, _generate(eng))  # same instance: the reference sees the loaded weights too
        names = dict(new)
        assert all(torch.equal(p, names[n]) for n, p in model.named_parameters() if n in names)
    finally:
        eng.shutdown()
