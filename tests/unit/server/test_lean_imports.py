"""server/lean_imports.py: packages hidden from imports inside the block, in the server's processes only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import importlib.util, json, sys
    from asyncgrpo.server import lean_imports
    from transformers.utils.import_utils import _is_package_available
    if sys.argv[1] == "enabled":
        lean_imports.enable()
    import json as already  # imported before the block: never hidden
    out = {}
    with lean_imports.without_unused_packages(("tabnanny", "json")) as hidden:
        out["hidden"] = hidden
        out["spec_inside"] = importlib.util.find_spec("tabnanny") is not None
        out["transformers_sees_it"] = bool(_is_package_available("tabnanny")[0])
        try:
            import tabnanny  # noqa: F401
            out["import_inside"] = True
        except ImportError:
            out["import_inside"] = False
        out["json_inside"] = sys.modules.get("json") is already
    import tabnanny  # noqa: F401,F811
    out["import_after"] = "tabnanny" in sys.modules and sys.modules["tabnanny"] is not None
    print(json.dumps(out))
    """
)


def _probe(mode: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env}, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_server_process_hides_the_package_from_imports_and_transformers_then_gives_it_back():
    out = _probe("enabled")
    assert out["hidden"] == ["tabnanny"]  # json was imported before: left as it is
    assert out["spec_inside"] is False and out["transformers_sees_it"] is False and out["import_inside"] is False
    assert out["json_inside"] is True
    assert out["import_after"] is True


@pytest.mark.parametrize("mode,env", [("not_enabled", {}), ("enabled", {"ASYNCGRPO_LEAN_IMPORTS": "0"})])
def test_outside_the_servers_processes_or_turned_off_nothing_is_hidden(mode, env):
    out = _probe(mode, **env)
    assert out["hidden"] == []
    assert out["spec_inside"] is True and out["transformers_sees_it"] is True and out["import_inside"] is True


COMMAND_PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    seen = {}

    class Probe:  # asked for asyncgrpo.config first: is scikit-learn hidden at that moment?
        def find_spec(self, name, path=None, target=None):
            if name == "asyncgrpo.config":
                seen["hidden_while_config_imports"] = "sklearn" in sys.modules and sys.modules["sklearn"] is None
            return None

    sys.meta_path.insert(0, Probe())
    if sys.argv[1] == "command":
        from asyncgrpo.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["train", "--help"])
    else:  # a user's process calling the same function: nothing hidden
        from asyncgrpo.cli.launch import import_config
        import_config()
    seen["config_imported"] = "asyncgrpo.config" in sys.modules
    seen["given_back"] = sys.modules.get("sklearn", "absent") is not None
    print(json.dumps(seen))
    """
)


@pytest.mark.parametrize("mode,hidden", [("command", True), ("user_process", False)])
def test_the_asyncgrpo_command_imports_the_config_without_scikit_learn(mode, hidden):
    """``asyncgrpo train`` imports transformers (through the config) with scikit-learn hidden: transformers <= 5.17
    imports it with its generation code, 0.5 s of the trainer's start. A user's process is left alone."""
    done = subprocess.run([sys.executable, "-c", COMMAND_PROBE, mode], capture_output=True, text=True, timeout=120,
                          check=True)  # fmt: skip
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"hidden_while_config_imports": hidden, "config_imported": True, "given_back": True}
