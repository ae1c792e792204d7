"""The run's MPS daemon on a machine without it: clear errors, nothing left changed; the YAML's server.mps key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncgrpo.cli.launch import run_train, wants_mps
from asyncgrpo.cli.run_config import check_server
from asyncgrpo.errors import UserError
from asyncgrpo.server.mps import MPS_ENV, MpsUnavailable, mps_daemon, mps_problem


@pytest.fixture
def no_mps_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def test_without_the_control_program_the_daemon_says_what_to_do(no_mps_on_path: None) -> None:
    before = {k: os.environ.get(k) for k in MPS_ENV}
    assert "nvidia-cuda-mps-control is not on PATH" in (mps_problem() or "")
    with pytest.raises(MpsUnavailable, match=r"not on PATH .*server: \{mps: false\}"), mps_daemon():
        pass
    assert {k: os.environ.get(k) for k in MPS_ENV} == before


def _yaml(tmp_path: Path, server: str) -> str:
    p = tmp_path / "run.yaml"
    p.write_text(f"model: demo\ndataset: {{recipe: reasoning_gym}}\nargs: {{output_dir: {tmp_path}/o}}\n{server}\n")
    return str(p)


def test_the_yaml_key_is_read_before_anything_starts(tmp_path: Path, no_mps_on_path: None) -> None:
    assert wants_mps(["--config", _yaml(tmp_path, "server: {embedded: true, mps: true}")])
    assert not wants_mps(["--config", _yaml(tmp_path, "server: {embedded: true}")])
    assert not wants_mps(["--config", _yaml(tmp_path, "server: {embedded: true, mps: true}"), "--help"])
    with pytest.raises(UserError, match="MPS: nvidia-cuda-mps-control is not on PATH"):
        run_train(["--config", _yaml(tmp_path, "server: {embedded: true, mps: true}")])


def test_server_mps_checks() -> None:
    assert check_server({"embedded": True, "mps": True})["mps"] is True
    with pytest.raises(UserError, match="server.mps must be true or false"):
        check_server({"embedded": True, "mps": "yes"})
    with pytest.raises(UserError, match="needs server.embedded: true"):
        check_server({"mps": True})
