"""``AsyncRolloutLoop.render_prompt`` renders a group's shared prompt once (a chat template costs ~0.5 ms on the
worker's event loop). Reference: the real tokenizer's own ``apply_chat_template`` of the same messages."""

from __future__ import annotations

from typing import Any

from asyncgrpo import AsyncGRPOConfig, AsyncRolloutLoop
from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.rollout import loop as loop_module
from asyncgrpo.trainer.server_setup import ServerFacts
from asyncgrpo.trainer.worker_settings import build_rollout_settings

FACTS = ServerFacts(model_name="policy", max_model_len=512, kv_cache_tokens=8192, has_metrics=True,
                    masks_supported=False, world_size=1, dtype=None, weight_backend=None)  # fmt: skip


class CountingTokenizer:
    """The real tokenizer, counting its chat-template renderings."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.calls = tokenizer, 0

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.tokenizer.apply_chat_template(*args, **kwargs)


def test_a_groups_prompt_is_rendered_once_and_equals_the_template(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    counting = CountingTokenizer(tokenizer)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], max_steps=1)
    settings = build_rollout_settings(args, FACTS, start_index=0, token_budget=400, eos_token_id=2)
    loop = AsyncRolloutLoop(settings, [], [], counting)
    a = [{"role": "user", "content": "What is 2 + 3?"}]
    b = [{"role": "user", "content": "What is 2 + 4?"}]
    expected = list(tokenizer.apply_chat_template(a, add_generation_prompt=True, tokenize=True)["input_ids"])
    got = [loop.render_prompt(a) for _ in range(8)]  # one group's rollouts
    assert all(ids == expected for ids in got) and counting.calls == 1
    got[0].append(99)  # each caller owns its list
    assert loop.render_prompt([dict(m) for m in a]) == expected and counting.calls == 1  # equal content, a copy
    assert loop.render_prompt(b) != expected and counting.calls == 2
    monkeypatch.setattr(loop_module, "RENDER_CACHE_SIZE", 2)
    loop.render_prompt([{"role": "user", "content": "a third"}])  # evicts the oldest (a)
    assert loop.render_prompt(a) == expected and counting.calls == 4
