"""A CPU-only install has no Triton (issue 34): with it hidden, every module but the Triton programs imports,
``asyncgrpo serve --device cpu`` answers, and ``asyncgrpo train`` loads its config, all without looking Triton up.

Triton is hidden by ``tests/helpers/hide_triton/sitecustomize.py`` (first on ``PYTHONPATH``, so the server's
children get it too); it also logs every lookup made from an ``asyncgrpo`` file, which must stay empty here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

import asyncgrpo
from asyncgrpo.server.launcher import launch_server
from tests.helpers.servers import SERVER_START_TIMEOUT_S

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "tests" / "helpers" / "hide_triton"
PACKAGE = Path(asyncgrpo.__file__).parent
# the Triton programs: the only modules allowed to import triton (on the first CUDA use)
TRITON_MODULES = {f"asyncgrpo.server.layers.{m}" for m in ("decode_kernel", "prefill_kernel", "fused_triton",
                                                          "sample_triton")} | {
    "asyncgrpo.packing.path_gather_triton", "asyncgrpo.trainer.head_triton"}  # fmt: skip


def hidden_env(log: Path) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(HOOK), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HIDE_TRITON_LOG": str(log), "CUDA_VISIBLE_DEVICES": ""}


def run_hidden(code: str, *argv: str, log: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *argv], env=hidden_env(log), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, check=False)  # fmt: skip


def all_modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


IMPORT_ALL = """
import importlib, importlib.util, json, sys
names, kernels = json.loads(sys.argv[1]), set(json.loads(sys.argv[2]))
assert importlib.util.find_spec("triton") is None, "the hook did not hide triton"
for name in names:
    if name not in kernels:
        importlib.import_module(name)
refused = []
for name in sorted(kernels):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        refused.append((name, e.name))
from asyncgrpo.triton_support import load_kernels
first = load_kernels("asyncgrpo.server.layers.fused_triton", "the fused layer kernels of the CUDA engine")
again = load_kernels("asyncgrpo.server.layers.fused_triton", "the fused layer kernels of the CUDA engine")
print(json.dumps({"refused": refused, "loaded": [first is not None, again is not None]}))
"""


def test_every_module_but_the_triton_programs_imports_without_triton(tmp_path):
    names = [n for n in all_modules() if n != "asyncgrpo.__main__"]  # __main__ would run the command
    assert TRITON_MODULES <= set(names), "a Triton program moved: update TRITON_MODULES"
    done = run_hidden(IMPORT_ALL, json.dumps(names), json.dumps(sorted(TRITON_MODULES)), log=tmp_path / "lookups")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["refused"] == [[m, "triton"] for m in sorted(TRITON_MODULES)]  # the hook works on them
    assert got["loaded"] == [False, False]
    hints = [line for line in done.stderr.splitlines() if "pip install triton" in line]
    assert len(hints) == 1, done.stderr[-3000:]  # one line, naming the package, however often it is asked


def test_cpu_server_starts_and_answers_without_triton(tmp_path, tiny_llama_dir):
    log = tmp_path / "lookups"
    env = {k: v for k, v in hidden_env(log).items() if os.environ.get(k) != v}
    with launch_server(tiny_llama_dir, extra_args=["--device", "cpu", "--max-model-len", "128"], env=env,
                       timeout=SERVER_START_TIMEOUT_S) as server:  # fmt: skip
        with urllib.request.urlopen(server.base_url + "/v1/models", timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
        body = {"model": model, "prompt": [1, 504, 3032], "max_tokens": 4, "temperature": 1.0, "ignore_eos": True}
        req = urllib.request.Request(server.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.load(r)
        alive = server.alive()
    assert alive, server.log_tail()
    assert answer["usage"]["completion_tokens"] == 4, answer
    assert not log.exists(), log.read_text()  # nothing in the server (or its children) even looked Triton up


LOAD_CONFIG = """
import sys
from asyncgrpo.cli.launch import parse_train
spec, _ = parse_train(["--config", sys.argv[1], "--max_steps", "2"])
fn = spec.reward_funcs[0]
print(f"{fn.__module__}:{fn.__name__} max_steps={spec.args.max_steps}")
"""


def test_train_help_and_an_old_path_config_load_without_triton(tmp_path, tiny_llama_dir):
    """``asyncgrpo train --help``, and the whole config check with transformers' AsyncGRPOConfig, of a YAML that
    names its reward by the path 0.1.0's docs showed: it loads with one deprecation line naming the new path."""
    log = tmp_path / "lookups"
    helped = subprocess.run([sys.executable, "-m", "asyncgrpo", "train", "--help"], env=hidden_env(log), cwd=ROOT,
                            capture_output=True, text=True, timeout=180, check=False)  # fmt: skip
    assert helped.returncode == 0 and "--max_steps" in helped.stdout, helped.stderr[-3000:]
    cfg = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    cfg["model"] = str(tiny_llama_dir)
    cfg["reward_funcs"] = ["asyncgrpo.recipes.tasks:numeric_answer_reward"]
    cfg["args"]["output_dir"] = str(tmp_path / "out")
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(cfg))
    done = run_hidden(LOAD_CONFIG, str(tmp_path / "old.yaml"), log=log)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "asyncgrpo.tasks.reasoning:numeric_answer_reward max_steps=2"
    moved = [line for line in done.stderr.splitlines() if "moved to" in line]
    assert len(moved) == 1, done.stderr[-3000:]
    assert "asyncgrpo.recipes.tasks moved to asyncgrpo.tasks.reasoning" in moved[0]
    assert not log.exists(), log.read_text()


@pytest.mark.long
def test_a_run_trains_without_triton_from_an_old_path_config(tmp_path, tiny_llama_dir):
    """``asyncgrpo train`` end to end (embedded CPU server, rollout worker, trainer) with Triton hidden, from a
    YAML whose first reward has 0.1.0's path: one step, the model saved, one deprecation line, no lookup."""
    log = tmp_path / "lookups"
    cfg = {
        "model": str(tiny_llama_dir),
        "dataset": {"recipe": "reasoning_gym", "task": "chain_sum", "size": 16, "seed": 0, "system_prompt": None},
        # the tiny random model never answers right: the second reward gives groups a spread to train on
        "reward_funcs": ["asyncgrpo.recipes.tasks:numeric_answer_reward", "tests.helpers.rewards:even_token_reward"],
        "server": {"embedded": True, "device": "cpu", "args": ["--max-model-len", "256", "--kv-cache-tokens", "16384"]},
        "args": {"output_dir": str(tmp_path / "out"), "max_steps": 1, "num_generations": 4, "max_completion_length": 12,
                 "token_budget": 384, "gradient_checkpointing": False, "save_strategy": "no", "report_to": [],
                 "vllm_server_timeout": 120, "rollout_worker_timeout": 60},
    }  # fmt: skip
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "asyncgrpo", "train", "--config", str(tmp_path / "old.yaml")],
                          env=hidden_env(log), cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    moved = [line for line in (done.stdout + done.stderr).splitlines() if " moved to " in line]
    assert len(moved) == 1 and "asyncgrpo.recipes.tasks moved to asyncgrpo.tasks.reasoning" in moved[0], moved
    assert not log.exists(), log.read_text()
