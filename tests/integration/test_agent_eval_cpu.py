"""Agent eval sets end to end on CPU (issue 36): episodes through the training's rollout loop, tools and
environment, against a real server on the tiny random-init Llama.

The environment (``tests/helpers/eval_agents.EchoEnv``) records every call and reward in this process; the loop
(``ScriptedCallLoop``) sends every turn to the server and writes a call of the environment's tool with the token
the server sampled. Expected figures are recomputed here from those records with the pass@k formula.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import yaml
from transformers import AutoTokenizer

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.tasks.eval_sets import EvalSet, evaluate_sets
from asyncgrpo.tasks.evaluate import EvalSettings
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from tests.helpers import eval_agents
from tests.helpers.eval_agents import EchoEnv, ScriptedCallLoop, echo_reward
from tests.helpers.rewards import even_token_reward

pytestmark = pytest.mark.slow

ROWS, SAMPLES, ITERATIONS = 3, 4, 2


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "512", "--kv-cache-tokens", "16384")


def _held_out(size: int = ROWS):
    return reasoning_gym_dataset("chain_sum", size=size, seed=3, system_prompt=None)


def _pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _expected(rewards: list[dict], answers: list[str]) -> dict[str, float]:
    """pass@k and mean@n per the formula, from what the environment itself returned (rows told by their answer)."""
    per_row = [[r["reward"] for r in rewards if r["answer"] == a] for a in answers]
    assert all(len(rs) == SAMPLES for rs in per_row), per_row
    out = {f"pass@{k}": sum(_pass_at_k(SAMPLES, int(sum(rs)), k) for rs in per_row) / len(per_row) for k in (1, 2, 4)}
    out[f"mean@{SAMPLES}"] = sum(sum(rs) / SAMPLES for rs in per_row) / len(per_row)
    return out


def test_agent_set_runs_the_tool_loop_and_its_reward_reaches_pass_at_k(server, tiny_llama_dir):
    eval_agents.clear()
    ds = _held_out()
    answers = list(ds["answer"])
    assert len(set(answers)) == ROWS  # rows are told apart by their answer
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    base = EvalSettings(base_url=server.base_url, max_tokens=8, temperature=1.0, num_samples=1, timeout=120)
    sets = {"agent": EvalSet(ds, reward_funcs=[], num_samples=SAMPLES, environment_factory=EchoEnv,
                             max_tool_calling_iterations=ITERATIONS)}  # fmt: skip
    scores = evaluate_sets(tok, sets, [], base, loop_cls=ScriptedCallLoop)
    episodes = ROWS * SAMPLES
    # The loop called the tool on each turn until max_tool_calling_iterations, in this process: ITERATIONS calls and
    # ITERATIONS + 1 server turns per episode, each episode's environment scored once.
    assert len(eval_agents.CALLS) == episodes * ITERATIONS
    assert {c["pid"] for c in eval_agents.CALLS} == {os.getpid()}
    assert len(eval_agents.TURNS) == episodes * (ITERATIONS + 1)
    assert len(eval_agents.REWARDS) == episodes and all(r["calls"] == ITERATIONS for r in eval_agents.REWARDS)
    assert scores["eval/agent/tools/call_frequency"] == ITERATIONS
    assert scores["eval/agent/tools/loop_exhausted_frac"] == 1.0
    assert scores["eval/agent/rollout/turns_mean"] == ITERATIONS + 1
    # The environment's reward is the episode's total: it reaches reward, rewards/EchoEnv/mean and pass@k.
    for call_tokens in ({c["token"] for c in eval_agents.CALLS if c["answer"] == a} for a in answers):
        assert call_tokens  # every row's episodes called the tool
    mean_reward = sum(r["reward"] for r in eval_agents.REWARDS) / episodes
    assert scores["eval/agent/reward"] == pytest.approx(mean_reward)
    assert scores["eval/agent/rewards/EchoEnv/mean"] == pytest.approx(mean_reward)
    assert scores["eval/agent/num_prompts"] == ROWS
    for name, value in _expected(eval_agents.REWARDS, answers).items():
        assert scores[f"eval/agent/{name}"] == pytest.approx(value), name
    assert "eval/agent/pass@8" not in scores and "eval/agent/maj@1" not in scores  # 4 samples; no answer reader


def test_agent_set_in_training_leaves_the_worker_alone(tmp_path, server, tiny_llama_dir):
    """At eval_steps the agent set runs in the trainer process while the worker generates beside it: the trainer's
    counters the worker's staleness admission reads do not move, and no episode reaches the training batches."""
    eval_agents.clear()
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    class Trainer(AsyncGRPOTrainer):
        loop_cls = ScriptedCallLoop

        def evaluate(self, *args, **kwargs):
            if self.worker is None:  # the last step stops the worker before its evaluation
                return super().evaluate(*args, **kwargs)
            ch = self.worker.channels
            before = (ch.tokens_consumed.value, ch.tokens_per_step.value, ch.policy_version.value)
            out = super().evaluate(*args, **kwargs)
            seen.append((before, (ch.tokens_consumed.value, ch.tokens_per_step.value, ch.policy_version.value)))
            return out

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2, max_completion_length=8, token_budget=256,
        vllm_server_base_url=server.base_url, report_to=[], save_strategy="no", gradient_checkpointing=False,
        vllm_server_timeout=120, rollout_worker_timeout=60, seed=0, eval_strategy="steps", eval_steps=1,
        max_tool_calling_iterations=ITERATIONS,
    )  # fmt: skip
    held_out = {"agent": EvalSet(_held_out(2), reward_funcs=[], num_samples=2, temperature=1.0,
                                 environment_factory=EchoEnv)}  # fmt: skip
    trainer = Trainer(str(tiny_llama_dir), reward_funcs=[even_token_reward], args=args,
                      train_dataset=_held_out(16), eval_dataset=held_out)  # fmt: skip
    assert trainer.train().global_step == 2
    assert len(seen) == 2 and all(before == after for before, after in seen)  # both with the worker live
    # Two evaluations (steps 1 and 2) of 2 rows x 2 episodes, ITERATIONS calls each, all in this process.
    assert len(eval_agents.REWARDS) == 8 and len(eval_agents.CALLS) == 8 * ITERATIONS
    assert {c["pid"] for c in eval_agents.CALLS} == {os.getpid()}
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/agent/reward" in r]
    assert [r["step"] for r in evals] == [1, 2]
    for r in evals:
        assert r["eval/agent/tools/call_frequency"] == ITERATIONS
    trained = [r for r in rows if "loss" in r]
    assert trained and not any(k.startswith("tools/") for r in trained for k in r)  # no episode was trained on


def test_asyncgrpo_eval_takes_an_agent_set_from_the_yaml(tmp_path, server, tiny_llama_dir, capsys):
    """The default loop: the random model calls nothing, so each episode's reward is its row's (echo_reward with no
    call) and the table's pass@1 is the fraction of even answers."""
    from asyncgrpo.cli.eval import run_eval

    eval_agents.clear()
    recipe = {"recipe": "reasoning_gym", "task": "chain_sum", "size": 4, "seed": 3, "system_prompt": None}
    config = {
        "model": str(tiny_llama_dir), "dataset": recipe, "reward_funcs": ["tests.helpers.rewards:even_token_reward"],
        "eval_datasets": {"agent": {**recipe, "environment_factory": "tests.helpers.eval_agents:EchoEnv",
                                    "reward_funcs": [], "num_samples": 2, "temperature": 1.0,
                                    "max_tool_calling_iterations": 1}},
        "server": {"embedded": False},
        "args": {"output_dir": str(tmp_path / "out"), "vllm_server_base_url": server.base_url,
                 "max_completion_length": 8, "report_to": []},
    }  # fmt: skip
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(config))
    assert run_eval(["--model", str(tiny_llama_dir), "--config", str(path)]) == 0
    answers = list(reasoning_gym_dataset("chain_sum", size=4, seed=3, system_prompt=None)["answer"])
    expected = sum(echo_reward(a, []) for a in answers) / 4
    assert not eval_agents.CALLS and len(eval_agents.REWARDS) == 8
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("agent: 4 prompts x 2 samples (temperature 1) ") and f"reward {expected:.4f}" in lines[0]
    assert lines[1].split()[:3] == ["per", "episode:", "0.0000"]  # no tool call
    assert lines[3].split() == ["1", f"{expected:.4f}", f"{expected:.4f}"]  # k, mean@1, pass@1
