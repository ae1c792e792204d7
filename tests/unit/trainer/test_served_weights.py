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
