"""Agent RL with a tool environment: SmolLM2-135M-Instruct learns to use a calculator.

    python examples/agent_calculator.py --out calc.json            # one GPU: server + trainer share it (gloo sync)
    python examples/agent_calculator.py --two-gpus --out calc.json # server on GPU 0, trainer on GPU 1 (NCCL sync)
    python examples/agent_calculator.py --model DIR ...            # another checkpoint (default: the demo model)

Each episode is "What is A op B?" with 2-3 digit numbers, too hard for a 135M model to do in its head. The
``CalculatorEnv`` exposes one tool, ``calculate(expression)``; its ``get_reward`` pays 0.5 when a call returned
the right value, and ``answer_reward`` pays 1.0 when the final answer is right. The base model never writes
``<tool_call>`` blocks, so a short supervised warm-up on synthetic transcripts comes first
(``asyncgrpo.assets.tool_warmup``), then async GRPO. Held-out episodes are evaluated (greedy) on the base,
warmed-up and trained models: environment reward, answer accuracy and tool-call success rate.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import operator
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
        return _AST_OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("only integers and + - * are allowed")


class CalculatorEnv:
    """One arithmetic episode; the row's ``a``, ``b``, ``op`` columns arrive in ``reset``."""

    def reset(self, a: int, b: int, op: str, **kwargs: Any) -> None:
        self.expected = OPS[op](a, b)
        self.correct_calls = 0

    def get_reward(self) -> float:
        return 0.5 if self.correct_calls else 0.0

    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression of integers with + - * and parentheses.

        Args:
            expression: The expression, for example "123 * 45".

        Returns:
            The value of the expression.
        """
        value = _evaluate(ast.parse(expression, mode="eval").body)
        self.correct_calls += value == self.expected
        return str(value)


class AnswerCalculatorEnv(CalculatorEnv):
    """The calculator for rows that carry only an ``answer`` column (a reasoning-gym set, e.g. in a YAML's
    ``eval_datasets``: ``examples/eval_agent.yaml``); a call whose value is the answer earns the 0.5."""

    def reset(self, answer: str, **kwargs: Any) -> None:  # type: ignore[override]
        self.expected = int(answer)
        self.correct_calls = 0


def final_number(completion: list[dict[str, Any]]) -> int | None:
    """The last integer of the last assistant message (the model's answer), or None."""
    last = next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")
    found = re.findall(r"-?\d+", last.split("</tool_call>")[-1])
    return int(found[-1]) if found else None


def answer_reward(completions: list[list[dict[str, Any]]], answer: list[int], **kwargs: Any) -> list[float]:
    return [1.0 if final_number(c) == int(a) else 0.0 for c, a in zip(completions, answer)]


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        op = rng.choice(list(OPS))
        a, b = rng.randint(10, 999), rng.randint(10, 99 if op == "*" else 999)
        content = f"What is {a} {op} {b}?"
        rows.append(
            {"prompt": [{"role": "user", "content": content}], "a": a, "b": b, "op": op, "answer": OPS[op](a, b)}
        )
    return rows


def transcripts(rows: list[dict[str, Any]]) -> list[Any]:
    from asyncgrpo.assets.tool_warmup import Transcript

    out = []
    for r in rows:
        expr = f"{r['a']} {r['op']} {r['b']}"
        call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "' + expr + '"}}\n</tool_call>'
        messages = [
            *r["prompt"],
            {"role": "assistant", "content": call},
            {"role": "tool", "content": str(r["answer"])},
            {"role": "assistant", "content": f"The answer is {r['answer']}."},
        ]
        out.append(Transcript(messages, [CalculatorEnv.calculate]))
    return out


async def evaluate(
    base_url: str, tokenizer: Any, rows: list[dict[str, Any]], max_iterations: int = 2
) -> dict[str, float]:
    """Greedy episodes through the server: env reward (get_reward + answer_reward), accuracy, tool-call success."""
    from asyncgrpo.client.http_client import AsyncServerClient
    from asyncgrpo.rollout.agents import ToolLoopSettings, environment_tools, run_tool_loop
    from asyncgrpo.types import TurnRecord

    def render(messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[int]:
        enc = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    async with AsyncServerClient(base_url, max_connections=64) as client:

        async def turn(prompt_ids: list[int]) -> TurnRecord:
            params = {"max_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "logprobs": 0}
            res = await client.complete(prompt_ids, params)
            return TurnRecord(prompt_ids=list(prompt_ids), output_ids=res.token_ids, output_log_probs=res.logprobs)

        async def episode(row: dict[str, Any]) -> tuple[float, float, int, int]:
            env = CalculatorEnv()
            env.reset(**row)
            rollout, _ = await run_tool_loop(
                row["prompt"], environment_tools(env), render=render, generate_turn=turn,
                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), executor=None,
                settings=ToolLoopSettings(max_iterations, 1024),
            )  # fmt: skip
            correct = answer_reward([rollout.completion], [row["answer"]])[0]
            return env.get_reward() + correct, correct, rollout.tool_call_count, rollout.tool_failure_count

        results = await asyncio.gather(*(episode(r) for r in rows))
    calls = sum(r[2] for r in results)
    return {
        "env_reward": sum(r[0] for r in results) / len(results),
        "answer_accuracy": sum(r[1] for r in results) / len(results),
        "episodes_with_call": sum(r[2] > 0 for r in results) / len(results),
        "tool_call_success_rate": (calls - sum(r[3] for r in results)) / calls if calls else 0.0,
        "episodes": len(results),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.environ.get("ASYNCGRPO_AGENT_MODEL"), help="checkpoint dir (default: demo)")
    p.add_argument("--out", default="agent_calculator.json")
    p.add_argument("--two-gpus", action="store_true")
    p.add_argument("--steps", type=int, default=60, help="RL optimizer steps")
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--eval-episodes", type=int, default=200)
    p.add_argument("--max-minutes", type=float, default=7.0, help="stop RL early to stay inside this wall time")
    a = p.parse_args(argv)
    if a.two_gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = "1"  # the trainer's GPU; the server child gets GPU 0
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.assets import demo_model_dir
    from asyncgrpo.assets.tool_warmup import supervised_tool_warmup
    from asyncgrpo.rollout.agents import prepare_tool_template
    from asyncgrpo.server.launcher import launch_server

    t_start = time.time()
    out = Path(a.out)
    work = out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    model_dir = Path(a.model) if a.model else demo_model_dir()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    server_args = ["--device", device, "--dtype", "float32", "--max-model-len", "1024"]
    if device == "cuda" and not a.two_gpus:
        server_args += ["--gpu-memory-utilization", "0.3", "--weight-transfer-config", '{"backend": "gloo"}']
    server_env = {"CUDA_VISIBLE_DEVICES": "0"} if a.two_gpus else {}
    train_rows, eval_rows = make_rows(512, seed=0), make_rows(a.eval_episodes, seed=1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prepare_tool_template(tok)
    report: dict[str, Any] = {
        "model": str(model_dir),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
    }

    def run_eval(path: Path, label: str) -> None:
        with launch_server(
            path, extra_args=server_args, env=server_env, log_path=work / f"server-{label}.log", timeout=600
        ) as srv:
            report[label] = asyncio.run(evaluate(srv.base_url, tok, eval_rows))
        print(label, json.dumps(report[label]), flush=True)

    run_eval(model_dir, "base")
    # Supervised warm-up: the base model never writes <tool_call> blocks, so RL alone would get no signal.
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    losses = supervised_tool_warmup(
        model, tok, transcripts(train_rows[:256]), steps=a.warmup_steps, lr=2e-5, batch_size=16
    )
    warm_dir = work / "warm"
    model.save_pretrained(warm_dir)
    tok.save_pretrained(warm_dir)
    del model
    report["warmup"] = {
        "steps": a.warmup_steps,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "s": time.time() - t0,
    }
    deadline = t_start + 60 * a.max_minutes

    class StopAtDeadline(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_training_stop = control.should_training_stop or time.time() > deadline

    with launch_server(
        warm_dir, extra_args=server_args, env=server_env, log_path=work / "server-rl.log", timeout=600
    ) as srv:
        report["warmed_up"] = asyncio.run(evaluate(srv.base_url, tok, eval_rows))
        print("warmed_up", json.dumps(report["warmed_up"]), flush=True)
        t0 = time.time()
        args = AsyncGRPOConfig(
            output_dir=str(work / "rl"), max_steps=a.steps, num_generations=8, max_completion_length=64,
            max_tool_calling_iterations=2, token_budget=16384, learning_rate=5e-6, temperature=1.0,
            vllm_server_base_url=srv.base_url, report_to=[], save_strategy="no", logging_steps=1,
            gradient_checkpointing=False, max_staleness=2, seed=0,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(
            str(warm_dir), reward_funcs=answer_reward, args=args, train_dataset=train_rows,
            processing_class=tok, environment_factory=CalculatorEnv, callbacks=[StopAtDeadline()],
        )  # fmt: skip
        state = trainer.train()
        report["rl"] = {"steps": state.global_step, "s": time.time() - t0}
        report["trained"] = asyncio.run(evaluate(srv.base_url, tok, eval_rows))  # the server holds the synced weights
        print("trained", json.dumps(report["trained"]), flush=True)
    rows = [json.loads(x) for x in (work / "rl" / "metrics.jsonl").read_text().splitlines()]
    report["reward_by_step"] = [r.get("reward") for r in rows if "reward" in r]
    report["wall_s"] = time.time() - t_start
    out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
