"""``asyncgrpo train`` end to end on the tiny model, then ``eval`` and ``report`` on what it left behind.

The module runs one real training process (embedded CPU server, rollout worker, trainer) and checks: the final
model loads with ``AutoModelForCausalLM.from_pretrained(output_dir)``, the summary line, the held-out score of
``asyncgrpo eval`` against completions this test requests itself, and the run doctor's page in a real browser.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.helpers.rewards import even_token_reward
from tests.integration.test_cli import asyncgrpo

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long lane: `make test-long`
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama_dir):
    """(the YAML, output_dir, the train process, (launch time, exit time)) of one 3-step run."""
    tmp = tmp_path_factory.mktemp("cli_train")
    cfg = {
        "model": str(tiny_llama_dir),
        "dataset": {"recipe": "reasoning_gym", "task": "chain_sum", "size": 16, "seed": 0, "system_prompt": None},
        "eval_dataset": {"recipe": "reasoning_gym", "task": "chain_sum", "size": 4, "seed": 1, "system_prompt": None},
        "reward_funcs": ["tests.helpers.rewards:even_token_reward"],
        "server": {"embedded": True, "device": "cpu", "args": ["--max-model-len", "256", "--kv-cache-tokens", "16384"]},
        "args": {
            "output_dir": str(tmp / "out"),
            "max_steps": 10,
            "num_generations": 4,
            "max_completion_length": 12,
            "token_budget": 384,
            "learning_rate": 1e-3,
            "gradient_checkpointing": False,
            "save_strategy": "no",
            "report_to": [],
            "seed": 0,
            "vllm_server_timeout": 120,
            "rollout_worker_timeout": 60,
            "eval_strategy": "steps",
            "eval_steps": 2,
        },
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    launched = time.time()
    proc = asyncgrpo("train", "--config", str(path), "--max_steps", "3", "--doctor-every", "2", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return path, tmp / "out", proc, (launched, time.time())


def test_train_saves_the_model_and_prints_a_summary(run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out, proc, launch = run
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "llama"
    AutoTokenizer.from_pretrained(out)
    summary = [line for line in proc.stdout.splitlines() if line.startswith("done: ")]
    assert len(summary) == 1 and "3 steps in" in summary[0] and f"saved to {out}" in summary[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r and "train_runtime" not in r]  # windows, not the summary
    assert f"reward {rewards[0]:.3g} -> {rewards[-1]:.3g}" in summary[0]
    # The start-up figures (issue 41): the first step ended within the process's life, as this test saw it
    windows = [r for r in rows if "train_runtime" not in r]
    first = windows[0]["perf/time_to_first_step_s"]
    assert 0 < first <= launch[1] - launch[0]
    startup = proc.stdout.splitlines()[proc.stdout.splitlines().index(summary[0]) + 1]
    share = [r["perf/warmup_share"] for r in windows if "perf/warmup_share" in r][-1]
    assert startup.startswith(f"start-up: first step {first:.1f} s after launch")
    assert f"warm-up {100 * share:.0f} % of training time" in startup


def test_train_prints_compact_lines_and_verdicts(run):
    _, _, proc, _ = run
    lines = proc.stdout.splitlines()
    steps = [line for line in lines if re.match(r"step +[123]/3  ", line)]
    assert any(line.startswith("step   3/3  ") for line in steps), proc.stdout[-2000:]
    # a window shows its reward, or says why not (a step can train only groups scored before it: timing)
    assert any(re.search(r"  reward [0-9.e-]+ ", line) for line in steps), steps
    assert all(re.search(r"  reward [0-9.e-]+ ", line) or line.endswith(")") for line in steps), steps
    assert "'batch/packing_ratio'" not in proc.stdout  # transformers' raw dict is off by default
    assert any(line.strip().startswith("doctor [") for line in lines)  # --doctor-every 2


def test_eval_dataset_is_scored_during_training(run):
    _, out, _, _ = run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    assert evals and evals[0]["step"] == 2 and evals[0]["eval/num_prompts"] == 4
    assert 0.0 <= evals[0]["eval/reward"] <= 1.0
    assert "eval/rewards/even_token_reward/mean" in evals[0]


def test_eval_command_matches_greedy_completions(run, serve):
    """The printed score equals the reward of greedy completions this test asks a separate server for."""
    from transformers import AutoTokenizer

    from asyncgrpo.client.http_client import AsyncServerClient
    from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

    path, out, _, _ = run
    with ThreadPoolExecutor(1) as pool:  # the reference server starts while the command runs
        starting = pool.submit(serve, out, "--max-model-len", "256")
        proc = asyncgrpo("eval", "--model", str(out), "--config", str(path), timeout=600)
        server = starting.result()
    assert proc.returncode == 0, proc.stderr[-4000:]
    score = float(
        re.search(r"eval: 4 prompts x 1 samples \(greedy\) in [0-9.]+s; reward ([0-9.]+)", proc.stdout).group(1)
    )

    tok = AutoTokenizer.from_pretrained(out)
    ds = reasoning_gym_dataset("chain_sum", size=4, seed=1, system_prompt=None)

    async def greedy() -> list[list[int]]:
        async with AsyncServerClient(server.base_url) as client:
            outs = []
            for row in ds:
                ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
                res = await client.complete(ids, {"max_tokens": 12, "temperature": 0.0})
                outs.append(res.token_ids)
            return outs

    expected = sum(even_token_reward(asyncio.run(greedy()))) / 4
    assert score == pytest.approx(expected, abs=1e-4)


def test_report_on_the_run(run):
    _, out, _, _ = run
    proc = asyncgrpo("report", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[ok]" in proc.stdout or "[!!]" in proc.stdout
    pngs = sorted(p.name for p in (out / "report").glob("*.png"))
    assert {"reward.png", "zero_std.png", "staleness.png", "wait.png", "entropy.png"} <= set(pngs)
    html = (out / "report" / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == len(pngs)


def _chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={cwd / 'profile'}",
        "--virtual-time-budget=10000",
    ]
    return subprocess.run([CHROMIUM, *flags, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_report_renders_in_a_browser(run, tmp_path):
    import numpy as np
    from PIL import Image

    _, out, _, _ = run
    if not (out / "report" / "report.html").is_file():
        assert asyncgrpo("report", str(out), timeout=300).returncode == 0
    page = out / "report" / "report.html"
    # 1. every <img> decoded: a copy of the page records, after load, how many images have pixels.
    probe = tmp_path / "probe.html"
    script = (
        "<script>window.addEventListener('load', () => { const imgs = [...document.images]; "
        "document.body.setAttribute('data-rendered', imgs.filter(i => i.complete && i.naturalWidth > 0)"
        ".length + '/' + imgs.length); });</script></body>"
    )
    probe.write_text(page.read_text().replace("</body>", script))
    dom = _chromium("--dump-dom", probe.as_uri(), cwd=tmp_path)
    rendered = re.search(r'data-rendered="(\d+)/(\d+)"', dom.stdout)
    assert rendered, dom.stdout[-500:] + dom.stderr[-2000:]
    n_png = len(list((out / "report").glob("*.png")))
    assert rendered.group(1) == rendered.group(2) == str(n_png)
    # 2. a screenshot of the page itself is not blank: many colours, a good share of non-white pixels.
    shot = tmp_path / "shot.png"
    _chromium(f"--screenshot={shot}", "--window-size=1400,2400", page.as_uri(), cwd=tmp_path)
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    colours = len(np.unique(pixels, axis=0))
    non_white = float((pixels.min(axis=1) < 240).mean())
    assert colours > 200 and non_white > 0.05, (colours, non_white)


def test_sampled_eval_keeps_top_k_on_a_masking_server(serve, tiny_llama_dir):
    """eval_temperature > 0 sends the training top_k (a --return-sampling-mask server needs one); seeded requests
    make the score reproducible, checked against the same requests sent by hand."""
    from transformers import AutoTokenizer

    from asyncgrpo.client.http_client import AsyncServerClient
    from asyncgrpo.tasks.evaluate import EvalSettings, evaluate_sync, render
    from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

    server = serve(tiny_llama_dir, "--max-model-len", "256", "--return-sampling-mask")
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ds = reasoning_gym_dataset("chain_sum", size=3, seed=2, system_prompt=None)
    s = EvalSettings(server.base_url, max_tokens=10, temperature=0.8, num_samples=2, seed=7, top_k=20)
    scores = evaluate_sync(tok, ds, [even_token_reward], s)

    async def by_hand() -> list[list[int]]:
        async with AsyncServerClient(server.base_url) as client:
            outs = []
            for i, row in enumerate(ds):
                params = {"max_tokens": 10, "temperature": 0.8, "n": 2, "seed": 7 + i, "top_k": 20}
                outs += [r.token_ids for r in await client.complete_n(render(tok, row["prompt"], None), params)]
            return outs

    ids = asyncio.run(by_hand())
    assert scores["eval/reward"] == pytest.approx(sum(even_token_reward(ids)) / len(ids), abs=1e-9)
    assert scores["eval/num_prompts"] == 3 and scores["eval/completions/mean_length"] == sum(map(len, ids)) / len(ids)
