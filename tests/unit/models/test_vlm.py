"""Vision-language checkpoints trained on text (SPEC T4): packed parity on the text model, frozen tower,
no tower optimizer state, no tower names in weight sync, prompts with images refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen3VLConfig

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.assets import smollm2_tokenizer, tiny_model_dir
from asyncgrpo.models.vlm import check_no_images, freeze_non_text, non_text_parameter_ids
from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.inputs import check_dataset
from asyncgrpo.trainer.logprobs import selective_logprobs
from asyncgrpo.weights.policy import policy_weight_metadata, policy_weights
from tests.helpers.reference import unpacked_logprobs_and_grads
from tests.helpers.synthetic import random_tree_samples

VOCAB = 97
TEXT = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}}  # fmt: skip
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 4,
          "out_hidden_size": 32, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}  # fmt: skip
ROWS = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def _vlm() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    return AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def _is_tower(name: str) -> bool:
    return name.startswith("model.visual.")


def _qwen3_5_vlm() -> torch.nn.Module:
    from asyncgrpo.assets import tiny_model

    return tiny_model("qwen3_5_vlm", vocab_size=VOCAB)  # DeltaNet hybrid text model behind a vision tower


@pytest.mark.parametrize("make", [_vlm, _qwen3_5_vlm], ids=["qwen3_vl", "qwen3_5_vlm"])
def test_packed_text_forward_matches_unpacked_vlm_forward(make):
    """Trainer path (tree attention over the text model + chunked head) == the full VLM forward per sample."""
    rng = np.random.default_rng(5)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=3)  # forks at several depths, 1-token segments
    row = pack_samples(samples)
    assert row.num_tokens < row.num_flat_tokens
    model = make()
    assert freeze_non_text(model) > 0
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))

    # reference: the image-text model's own forward on each sample alone, sdpa
    ref_lp, ref_grads = unpacked_logprobs_and_grads(model, samples, weights)

    model.zero_grad()
    use_tree_attention(model)
    hidden = packed_hidden_states(model, row, build_plan(row, "sdpa"))
    lp = selective_logprobs(hidden[row.pred_index], model.get_output_embeddings().weight, row.target_ids).logprobs
    (lp * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    assert (lp.detach() - ref_lp).abs().max().item() <= 1e-4
    text = {n for n, _ in model.named_parameters() if not _is_tower(n)}
    assert grads.keys() == ref_grads.keys() == text  # the tower gets no gradient at all
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name


def test_trainer_loads_vlm_with_frozen_tower_and_no_tower_optimizer_state(tmp_path):
    model_dir = tiny_model_dir("qwen3_vl")
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], learning_rate=1e-3)
    trainer = AsyncGRPOTrainer(
        str(model_dir), reward_funcs=[zero_reward], args=args,
        train_dataset=ROWS, processing_class=smollm2_tokenizer(),
    )  # fmt: skip
    model = trainer.model
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    names = dict(model.named_parameters())
    tower = [n for n in names if _is_tower(n)]
    assert tower and all(not names[n].requires_grad for n in tower)
    assert all(p.requires_grad for n, p in names.items() if not _is_tower(n))

    opt = trainer.create_optimizer()
    in_groups = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_groups == {id(p) for n, p in names.items() if not _is_tower(n)}
    for p in names.values():
        p.grad = torch.ones_like(p) if p.requires_grad else None
    opt.step()
    with_state = {n for n, p in names.items() if opt.state.get(p)}
    assert with_state and not any(_is_tower(n) for n in with_state)


def test_weight_sync_and_metadata_list_no_tower_names():
    model = _vlm()
    text = [n for n, _ in model.named_parameters() if not _is_tower(n)]
    meta = policy_weight_metadata(model)
    assert [m.name for m in meta] == text
    assert [n for n, _ in policy_weights(model)] == text
    assert non_text_parameter_ids(torch.nn.Linear(2, 2)) == set()  # not a VLM: nothing excluded


def test_lora_on_vlm_syncs_merged_text_weights_only():
    import peft

    model = _vlm()
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "qkv"]))
    freeze_non_text(peft_model)
    tower_lora = [n for n, p in peft_model.named_parameters() if "visual" in n and "lora_" in n]
    assert tower_lora and not any(p.requires_grad for n, p in peft_model.named_parameters() if n in tower_lora)
    names = [m.name for m in policy_weight_metadata(peft_model)]
    assert names and not any("visual" in n or "lora_" in n for n in names)
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in names


@pytest.mark.parametrize(
    "row, what",
    [
        ({**ROWS[0], "images": ["<PIL image>"]}, "'images' column"),
        ({**ROWS[0], "image": "cat.png"}, "'image' column"),
        ({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]}, "'image'"),
        ({"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
    ],
)
def test_prompts_with_images_are_refused(row, what):
    with pytest.raises(ValueError, match="images are not supported") as info:
        check_dataset([row])
    assert what in str(info.value)
    with pytest.raises(ValueError, match="text-only prompts"):
        check_no_images(row, "dataset row 3")


def test_text_only_rows_pass():
    check_no_images({**ROWS[0], "images": None}, "row")  # an empty image column is fine
    check_no_images({"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "row")


def test_qwen3_5_checkpoint_tower_is_frozen_and_not_synced():
    from asyncgrpo.assets import tiny_model

    model = tiny_model("qwen3_5_vlm")
    freeze_non_text(model)
    tower = [n for n, _ in model.named_parameters() if n.startswith("model.visual.")]
    assert tower and not any(p.requires_grad for n, p in model.named_parameters() if n in tower)
    names = [m.name for m in policy_weight_metadata(model)]
    assert names == [n for n, _ in model.named_parameters() if n not in tower]
