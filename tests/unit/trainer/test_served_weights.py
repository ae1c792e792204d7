"""The warning lines about what a server held before the run's first push (issue 30, item 1; issue 44, item 2)."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web

from asyncgrpo.trainer.served_weights import describe_served_weights, warn_on_foreign_weights
from tests.helpers.fake_http import ThreadedServer

URL = "http://localhost:8000"


def test_fresh_server_on_the_trainers_model_says_nothing(tmp_path):
    models = [{"id": str(tmp_path), "root": str(tmp_path), "parent": None}]
    assert describe_served_weights(URL, models, {"weight_version": "0"}, str(tmp_path)) == []
    # the same directory spelled another way (a relative path, a symlink) is the same model
    link = tmp_path.parent / (tmp_path.name + "-link")
    link.symlink_to(tmp_path)
    assert describe_served_weights(URL, models, None, str(link)) == []


def test_another_model_is_named():
    models = [{"id": "/ckpt/base", "root": "/ckpt/base", "parent": None}, {"id": "lora-1", "parent": "/ckpt/base"}]
    (line,) = describe_served_weights(URL, models, {"weight_version": "0"}, "/ckpt/sft-step-400")
    assert URL in line and "'/ckpt/base'" in line and "'/ckpt/sft-step-400'" in line


def test_an_earlier_runs_weights_are_named():
    models = [{"id": "m", "parent": None}]
    (line,) = describe_served_weights(URL, models, {"weight_version": "step-12"}, "m")
    assert URL in line and "'step-12'" in line and "before the first sample" in line
    both = describe_served_weights(URL, models, {"weight_version": "step-3"}, "other")
    assert len(both) == 2


def _fresh_server(model_id: str, version: str) -> ThreadedServer:
    """Answers /v1/models and /weight_info as a server on ``model_id`` holding weight version ``version``."""

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": model_id, "root": model_id}]})

    async def weight_info(request):
        return web.json_response({"weight_version": version})

    return ThreadedServer([web.get("/v1/models", models), web.get("/weight_info", weight_info)])


# "default": vLLM 0.32/0.33's EngineCore before any update (issue 44 item 2); "0": asyncgrpo's own server.
@pytest.mark.parametrize("version", ["default", "0"])
def test_a_fresh_server_over_http_gives_no_warning(version, caplog):
    with _fresh_server("m", version) as server, caplog.at_level(logging.WARNING):
        assert warn_on_foreign_weights([server.url], "m") == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_pushed_version_over_http_warns(caplog):
    with _fresh_server("m", "step-7") as server, caplog.at_level(logging.WARNING):
        (line,) = warn_on_foreign_weights([server.url], "m")
    assert "'step-7'" in line and server.url in line
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [line]


def _saved_copy(src, dst, edit=None):
    """What warm_up_tool_calls saves: the model loaded in float32 and the tokenizer with the tool template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncgrpo.rollout.agents import prepare_tool_template

    tok = AutoTokenizer.from_pretrained(src)
    prepare_tool_template(tok)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if edit is not None:
        edit(model, tok)
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return str(dst)


def test_a_copy_with_the_same_config_and_tokens_is_the_served_model(tiny_llama_dir, tmp_path):
    """Issue 44 item 5: docs/agents.md serves the demo model and trains its warm-up, a copy with another chat
    template; the warning said the server serves another model on every run of the documented steps."""
    served = [{"id": str(tiny_llama_dir), "root": str(tiny_llama_dir), "parent": None}]
    warm = _saved_copy(tiny_llama_dir, tmp_path / "warm")
    assert describe_served_weights(URL, served, {"weight_version": "0"}, warm) == []

    def more_tokens(model, tok):  # another vocabulary: the server would decode the trainer's ids wrongly
        tok.add_tokens(["<scratchpad>"])

    (line,) = describe_served_weights(URL, served, None, _saved_copy(tiny_llama_dir, tmp_path / "vocab", more_tokens))
    assert "not the trainer's model" in line

    def longer(model, tok):  # another config: the server's positions or shapes would not be the trainer's
        model.config.max_position_embeddings += 1

    (line,) = describe_served_weights(URL, served, None, _saved_copy(tiny_llama_dir, tmp_path / "config", longer))
    assert "not the trainer's model" in line
