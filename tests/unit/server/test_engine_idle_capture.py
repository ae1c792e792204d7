"""The engine thread captures CUDA graphs while it has nothing to run (``ModelRunner.capture_idle``), never while
paused, and serves requests in between. On CPU no graph exists, so the runner's hook is replaced by a recorder;
the CUDA captures themselves are checked by tests/gpu/test_engine_gpu.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, SamplingParams
from tests.unit.server.test_engine_batching import Collector


class IdleCaptures:
    """Stands for ``capture_idle``: ``left`` captures to make, then nothing; records whether a step ran meanwhile."""

    def __init__(self, left: int) -> None:
        self.left = left
        self.calls = 0
        self.made = 0
        self.done = threading.Event()

    def __call__(self) -> bool:
        self.calls += 1
        if self.left == 0:
            self.done.set()
            return False
        self.left -= 1
        self.made += 1
        return True


@pytest.fixture
def engine():
    eng = Engine(tiny_model_dir("qwen3"), max_model_len=96, max_num_seqs=8, kv_cache_tokens=2048, block_size=8)
    yield eng
    eng.shutdown()


def _serve_one(engine, rid: str) -> None:
    col = Collector()
    engine.submit(Request(rid, [5, 17, 99, 3], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)), col)
    out = col.wait([rid])[rid]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_the_idle_engine_captures_after_its_first_step_until_nothing_is_left_and_still_serves(engine):
    """No capture before the engine thread ran a step (its first matmul makes its cuBLAS handle, which a capture
    cannot); then one capture a call, each right after the other, and requests are still served."""
    hook = IdleCaptures(left=5)
    engine._runner.capture_idle = hook
    engine.start()
    time.sleep(0.3)  # several idle ticks before any request
    assert hook.calls == 0
    _serve_one(engine, "first")
    assert hook.done.wait(30), "the idle engine never asked for a capture"
    assert hook.made == 5  # one a call, each right after the other (no idle wait while captures are left)
    _serve_one(engine, "r")


def test_no_capture_while_paused(engine):
    hook = IdleCaptures(left=1000)
    engine._runner.capture_idle = hook
    engine.start()
    _serve_one(engine, "first")  # idle captures start after the engine thread's first step
    engine.pause("keep")
    calls = hook.calls
    time.sleep(0.3)  # several idle ticks of the paused engine
    assert hook.calls == calls
    engine.resume()
    deadline = time.monotonic() + 30
    while hook.calls == calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hook.calls > calls  # resumed: capturing again
