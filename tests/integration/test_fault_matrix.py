"""The fault matrix (issue 9, SPEC X3/X4/G4/G11/M1): real server, real trainer processes, real faults.

Every scenario runs the public API against a real ``asyncgrpo serve`` process on the tiny Llama and checks
what a user would see: how soon the run stops or recovers, and what it says. Scripts that must be killed run
in their own process (``fault_scripts/run_trainer.py``).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "fault_scripts"


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384")


def _pid_alive(pid: int) -> bool:
    """Running (a zombie, killed but not yet reaped by its new parent, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout:.0f}s for {what}")


def _server_counter(base_url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert m is not None, f"{name} missing from /metrics"
    return float(m.group(1))


def start_run(tmp_path: Path, server_url: str, model_dir: Path, name: str = "run", **settings) -> subprocess.Popen:
    """Start ``run_trainer.py`` in its own process; its stdout+stderr go to ``<name>/log.txt``."""
    where = tmp_path / name
    where.mkdir(parents=True, exist_ok=True)
    s = {"server_url": server_url, "model_dir": str(model_dir), "output_dir": str(tmp_path / "out"), **settings}
    (where / "settings.json").write_text(json.dumps(s))
    log = open(where / "log.txt", "w")  # noqa: SIM115 - the child writes to it until it ends
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "run_trainer.py"), str(where / "settings.json")],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )


# ---------------------------------------------------------------------------------------------- item 4


def test_worker_dies_with_a_sigkilled_trainer_and_stops_sending(tmp_path, server, tiny_llama_dir):
    proc = start_run(tmp_path, server.base_url, tiny_llama_dir, config={"max_steps": 200})
    try:
        pid_file = tmp_path / "run" / "worker.pid"
        _wait_for(lambda: proc.poll() is not None or pid_file.exists(), 240, "step 1 of the trainer process")
        assert proc.poll() is None, (tmp_path / "run" / "log.txt").read_text()[-3000:]
        worker_pid = int(pid_file.read_text())
        assert _pid_alive(worker_pid)
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=30)
        _wait_for(lambda: not _pid_alive(worker_pid), 10, f"the rollout worker (pid {worker_pid}) to exit")
        gone_after = time.monotonic() - t0
        assert gone_after < 5.0
        # In-flight requests end within a few seconds; after that the server sees no new ones.
        time.sleep(3.0)
        before = _server_counter(server.base_url, "vllm:generation_tokens_total")
        time.sleep(3.0)
        assert _server_counter(server.base_url, "vllm:generation_tokens_total") == before
    finally:
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------------------------------------- item 11


def test_script_without_main_guard_fails_fast_with_the_hint(tmp_path, server, tiny_llama_dir):
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / "unguarded.py"), server.base_url, str(tiny_llama_dir), str(tmp_path / "o")],
            check=False,
            capture_output=True,
            text=True,
            timeout=150,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"an unguarded script hung for {e.timeout:.0f}s instead of failing with the guard hint")
    elapsed = time.monotonic() - t0
    assert done.returncode != 0
    tail = done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in tail, tail
    assert "before it received its rollout loop" in tail, tail
    assert elapsed < 120


# ---------------------------------------------------------------------------------------------- item 8


def _post(url: str, body: bytes | dict, timeout: float = 60.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_deeply_nested_json_is_a_400(server):
    body = b"[" * 100_000 + b"]" * 100_000
    for path in ("/inference/v1/generate", "/v1/completions", "/init_weight_transfer_engine"):
        status, reply = _post(server.base_url + path, body)
        assert status == 400, (path, reply)
        assert "nests JSON too deeply" in reply["error"]["message"]
    assert urllib.request.urlopen(server.base_url + "/health", timeout=10).status == 200


def test_n_is_bounded(server):
    status, reply = _post(server.base_url + "/inference/v1/generate",
                          {"token_ids": [1, 2, 3], "sampling_params": {"n": 100_000, "max_tokens": 2}})  # fmt: skip
    assert status == 400 and reply["error"]["param"] == "n"
    assert "[1, 1024]" in reply["error"]["message"]


def test_tiny_temperature_is_greedy_with_finite_logprobs(server):
    def gen(temperature: float) -> dict:
        sp = {"temperature": temperature, "max_tokens": 6, "logprobs": 0, "seed": 1}
        status, reply = _post(
            server.base_url + "/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": sp}
        )
        assert status == 200, reply
        return reply["choices"][0]

    greedy, tiny = gen(0.0), gen(1e-41)
    assert tiny["token_ids"] == greedy["token_ids"]
    got = [e["logprob"] for e in tiny["logprobs"]["content"]]
    assert got == [e["logprob"] for e in greedy["logprobs"]["content"]]
    assert all(isinstance(v, float) for v in got)


def test_tiny_repetition_penalty_and_out_of_vocab_stop_ids_are_refused(server):
    url = server.base_url + "/inference/v1/generate"
    status, reply = _post(url, {"token_ids": [1, 2], "sampling_params": {"repetition_penalty": 1e-39}})
    assert status == 400 and reply["error"]["param"] == "repetition_penalty"
    status, reply = _post(url, {"token_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**12]}})
    assert status == 400 and reply["error"]["param"] == "stop_token_ids"
    vocab = json.loads(urllib.request.urlopen(server.base_url + "/server_info", timeout=10).read())
    assert "9223372036854775808" not in reply["error"]["message"]
    assert re.search(r"outside the vocabulary \[0, \d+\)", reply["error"]["message"]), (reply, vocab.keys())


def test_stray_init_does_not_silently_block_the_next_one(serve, tiny_llama_dir):
    """A stray init joins a group at an address nobody serves; the next init is answered at once, naming it."""
    import threading

    from asyncgrpo.server.launcher import free_port

    srv = serve(tiny_llama_dir, "--max-model-len", "64", "--weight-transfer-config",
                '{"backend": "gloo", "timeout_s": 20}')  # fmt: skip
    dead_port = free_port()
    stray = {"init_info": {"master_address": "127.0.0.1", "master_port": dead_port, "world_size": 2}}
    stray_reply: list = []
    t = threading.Thread(target=lambda: stray_reply.append(_post(srv.base_url + "/init_weight_transfer_engine", stray)))
    t.start()
    time.sleep(1.5)
    t0 = time.monotonic()
    real = {"init_info": {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}}
    status, reply = _post(srv.base_url + "/init_weight_transfer_engine", real, timeout=15)
    assert time.monotonic() - t0 < 5
    assert status == 409, reply
    assert f"127.0.0.1:{dead_port}" in reply["error"]["message"]
    t.join(60)
    assert stray_reply and stray_reply[0][0] >= 400  # the stray join itself fails at the server's timeout


# ---------------------------------------------------------------------------------------------- item 5


def test_unreachable_server_says_what_it_waits_for_every_30s(tmp_path, tiny_llama_dir, caplog):
    import logging

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.client.errors import ServerTimeoutError
    from asyncgrpo.recipes.tasks import reasoning_gym_dataset
    from asyncgrpo.server.launcher import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nobody listens here
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "o"), max_steps=1, vllm_server_base_url=url, report_to=[],
                           vllm_server_timeout=40, gradient_checkpointing=False)  # fmt: skip
    dataset = reasoning_gym_dataset("chain_sum", size=4, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[_len_reward], args=args, train_dataset=dataset)
    seen: list[float] = []
    t0 = time.monotonic()

    class Stamp(logging.Handler):
        def emit(self, record):
            if "not answering" in record.getMessage():
                seen.append(time.monotonic() - t0)

    handler = Stamp()
    logging.getLogger("asyncgrpo").addHandler(handler)
    caplog.set_level(logging.WARNING, logger="asyncgrpo.client.http_client")
    try:
        with pytest.raises(ServerTimeoutError, match="asyncgrpo serve"):
            trainer.train()
    finally:
        logging.getLogger("asyncgrpo").removeHandler(handler)
    assert time.monotonic() - t0 < 55
    assert seen and seen[0] <= 31.0, seen
    line = next(r.getMessage() for r in caplog.records if "not answering" in r.getMessage())
    assert url in line and "timeout 40s" in line and "asyncgrpo serve" in line and "for 30s" in line, line


def _len_reward(completion_ids, **kwargs):
    return [float(len(c)) for c in completion_ids]


# ---------------------------------------------------------------------------------------------- item 10


def test_dtype_warning_reads_vllms_own_field(server, caplog):
    """G13 against a server that reports its dtype only where vLLM does (the embedded server's own section removed)."""
    import logging

    import torch

    from asyncgrpo.trainer.server_setup import check_dtype, server_dtype

    info = json.loads(urllib.request.urlopen(server.base_url + "/server_info?config_format=json", timeout=10).read())
    info.pop("asyncgrpo", None)
    assert server_dtype(info) == "float32"  # the tiny model is served in fp32 on CPU
    caplog.set_level(logging.WARNING, logger="asyncgrpo.trainer.server_setup")
    check_dtype(torch.bfloat16, server_dtype(info))
    assert any("generates in float32" in r.getMessage() for r in caplog.records)
