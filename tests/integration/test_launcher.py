"""``launch_server`` starts a server of its own, never hands back another process that answers on its port.

The reference: a plain HTTP server (``http.server``) that answers 200 to everything, bound to the port first, as a
second test process's server could be after ``free_port`` handed both launchers the same number.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import urllib.request

import pytest
import torch

from asyncgrpo.server import launcher


class _AnswersEverything(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def squatter():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AnswersEverything)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.long  # a scenario of half a minute on 2 cores: `make test-long`
def test_a_taken_port_fails_the_start_with_the_fix_and_a_chosen_one_moves_on(squatter, tiny_llama_dir, monkeypatch):
    with pytest.raises(launcher.PortTaken, match=rf"127.0.0.1:{squatter} is answered by a process that is not an "
                                                 r"asyncgrpo server.*give it a free --port"):  # fmt: skip
        launcher.launch_server(tiny_llama_dir, port=squatter, extra_args=["--device", "cpu"], timeout=120)

    ports = iter([squatter, launcher.free_port()])
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports))
    server = launcher.launch_server(tiny_llama_dir, extra_args=["--device", "cpu"], timeout=120)
    try:
        assert not server.base_url.endswith(f":{squatter}")
        with urllib.request.urlopen(server.base_url + "/health", timeout=10) as r:
            assert r.status == 200 and r.headers[launcher.SERVER_PID_HEADER] == str(server.proc.pid)
    finally:
        server.stop()


@pytest.mark.long  # a scenario of half a minute on 2 cores: `make test-long`
def test_a_slow_start_says_what_it_waits_for(tiny_llama_dir, monkeypatch, caplog):
    monkeypatch.setattr(launcher, "LOG_EVERY_S", 0.5)  # a real start takes seconds (minutes for a large model)
    with caplog.at_level("INFO", logger="asyncgrpo.server.launcher"):
        server = launcher.launch_server(tiny_llama_dir, extra_args=["--device", "cpu"], timeout=120)
    server.stop()
    lines = [r.message for r in caplog.records if "waiting for the generation server at" in r.message]
    assert lines and server.base_url in lines[0] and str(server.log_path) in lines[0]


def test_a_launch_without_waiting_is_waited_for_later_and_reports_its_start(tiny_llama_dir):
    """``wait=False`` hands the process back while it starts; ``wait_ready`` waits (as often as asked). The engine
    runs in its own process, started before the API process's imports: both start splits reach /server_info."""
    server = launcher.launch_server(tiny_llama_dir, extra_args=["--device", "cpu", "--engine-process", "on",
                                                                "--max-model-len", "128"], timeout=120, wait=False)  # fmt: skip
    with server:
        assert server.alive() and not server.answers()  # a spawned interpreter does not serve within milliseconds
        assert server.wait_ready() is server and server.wait_ready() is server
        assert server.answers()
        with urllib.request.urlopen(server.base_url + "/health", timeout=10) as r:
            assert r.status == 200 and r.headers[launcher.SERVER_PID_HEADER] == str(server.proc.pid)
        with urllib.request.urlopen(server.base_url + "/server_info", timeout=10) as r:
            ours = json.load(r)["asyncgrpo"]
    engine, api = ours["start_s"]["engine"], ours["start_s"]["http"]
    assert list(engine) == ["process", "load", "kv", "sampler", "kernels", "graphs", "total"]
    assert list(api) == ["spawn_engine", "tokenizer", "imports", "engine", "app", "bind"]
    # each process's phases tile its start: they add up to its total (the API process's: launch to serving)
    assert sum(api.values()) == pytest.approx(ours["ready_s"], abs=0.01)
    assert sum(v for k, v in engine.items() if k != "total") == pytest.approx(engine["total"], abs=0.01)
    # the long phases are split into their parts, which add up to the phase (the model load's steps in order)
    parts = ours["start_parts_s"]
    # a Llama safetensors folder: loaded without transformers (server/models/direct_load.py)
    assert list(parts["engine"]["load"]) == ["config", "safetensors", "to_device", "native_model", "other"]
    assert list(parts["http"]["tokenizer"]) == ["torch_import", "transformers_import", "from_pretrained", "other"]
    for proc, phases in (("engine", engine), ("http", api)):
        for phase, split in parts[proc].items():
            assert sum(split.values()) == pytest.approx(phases[phase], abs=0.01), (proc, phase)
    assert not server.alive() and not server.answers()


def test_a_taken_port_fails_a_launch_without_waiting_at_wait_ready(squatter, tiny_llama_dir):
    """Without waiting, the URL is handed out at once, so a taken port is not moved away from: ``wait_ready``
    raises with the fix, and the process is stopped."""
    server = launcher.launch_server(tiny_llama_dir, port=squatter, extra_args=["--device", "cpu"], timeout=120,
                                    wait=False)  # fmt: skip
    assert server.base_url.endswith(f":{squatter}")
    assert not server.answers()  # answered, but not by this server: never "ready", and no raise here
    with pytest.raises(launcher.PortTaken, match=r"not an asyncgrpo server.*give it a free --port"):
        server.wait_ready()
    assert not server.alive()


def test_asyncgrpo_train_tells_an_embedded_server_on_device_auto_its_device(tiny_llama_dir, monkeypatch):
    """``server.device`` auto (the YAML's default) reaches the server as the device the trainer sees, so the server
    need not import torch to decide before it spawns its engine; the start is waited for after the trainer's."""
    from asyncgrpo.cli.launch import await_embedded, launch_embedded

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # leaves this test process's torch threads alone (split_cpu_threads)
    with contextlib.ExitStack() as stack:
        server = launch_embedded(stack, str(tiny_llama_dir), {"embedded": True, "args": ["--max-model-len", "64"]})
        argv = list(server.proc.args)
        assert argv[argv.index("--device") + 1] == ("cuda" if torch.cuda.is_available() else "cpu")
        assert await_embedded(server) is server
    assert not server.alive()
