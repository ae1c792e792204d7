"""The README's Train snippet and docs/agents.md's example run as written (issue 30, items 2 and 5): each
section's serve command, then its script.

Only what a test must change is changed, and each change must find its text exactly once (an edit that moves it
fails here, not silently): the server's port (a free one), the script's output folder and its length (one step
instead of twelve or ten). The model, dataset, reward and every setting are the documents'.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.readme]  # minutes each: `make test-readme`, not `make test`

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
AGENTS = (ROOT / "docs" / "agents.md").read_text()
SCRIPT_TIMEOUT_S = 420  # imports, the demo model, one step of 8 groups on 2 busy cores


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def _replace_once(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"the README snippet no longer contains {old!r} exactly once"
    return code.replace(old, new)


def test_train_snippet_runs_as_written(tmp_path, serve):
    section = _section(README, "Train")
    serve_line = next(line for b in _blocks(section, "bash") for line in b.splitlines() if "asyncgrpo serve" in line)
    argv = shlex.split(serve_line)
    assert argv[:3] == ["asyncgrpo", "serve", "demo"]
    flags = argv[3:]
    port = flags.index("--port")
    del flags[port : port + 2]  # a free port instead of 8000
    server = serve("demo", *flags)

    (code,) = [b for b in _blocks(section, "python") if "AsyncGRPOTrainer(" in b]
    code = _replace_once(code, '"http://localhost:8000"', repr(server.base_url))
    code = _replace_once(code, 'output_dir="out"', f"output_dir={str(tmp_path / 'out')!r}")
    code = _replace_once(code, "max_steps=8", "max_steps=1")
    script = tmp_path / "train.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, capture_output=True,
                          text=True, timeout=SCRIPT_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"^step +1/1 +reward", done.stdout, re.MULTILINE), done.stdout[-2000:]  # compact_log=True
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["sampling/sampling_logp_difference/max"] < 5e-3
    assert (tmp_path / "out" / "model.safetensors").is_file() and not list((tmp_path / "out").glob("checkpoint-*"))
    assert json.loads((tmp_path / "out" / "run_config.json").read_text())["args"]["num_generations"] == 8


def test_agents_snippet_warms_up_a_model_that_calls_tools_and_trains(tmp_path, serve):
    section = _section(AGENTS, "Example")
    (serve_line,) = [line for b in _blocks(section, "bash") for line in b.splitlines() if "asyncgrpo serve" in line]
    flags = shlex.split(serve_line)[3:]
    port = flags.index("--port")
    del flags[port : port + 2]
    server = serve("demo", *flags)

    (code,) = [b for b in _blocks(section, "python") if "AsyncGRPOTrainer(" in b]
    code = _replace_once(code, '"http://localhost:8000"', repr(server.base_url))
    code = _replace_once(code, 'output_dir="out"', f"output_dir={str(tmp_path / 'out')!r}")
    code = _replace_once(code, '"warm"', repr(str(tmp_path / "warm")))
    code = _replace_once(code, "max_steps=10", "max_steps=1")
    script = tmp_path / "agent.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=tmp_path, capture_output=True,
                          text=True, timeout=3 * SCRIPT_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    # the documented steps print what the warm-up does and warn about nothing (issue 44 item 5: the server serves
    # the demo model, the run trains its warmed-up copy: same config and tokens, so the same model)
    assert re.search(r"^tool warm-up: step 20/20, loss", done.stdout, re.MULTILINE), done.stdout[-2000:]
    assert "not the trainer's model" not in done.stderr, done.stderr[-4000:]
    warmed = json.loads((tmp_path / "warm" / "tool_warmup.json").read_text())
    assert warmed["reproduced"] >= 1, warmed  # the warm-up gave a model that calls the tool (greedy, in process)
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 1 and "tools/call_frequency" in r)
    assert first["tools/call_frequency"] > 0.5, first  # most rollouts call the tool
    assert first["sampling/sampling_logp_difference/max"] < 5e-3  # sampled from the warmed-up weights it pushed
