"""The warning lines about what a server held before the run's first push (issue 30, item 1)."""

from __future__ import annotations

from asyncgrpo.trainer.served_weights import describe_served_weights

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
