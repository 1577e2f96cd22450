"""`raydix serve` with direct ingress (its default on a local Ray): the ingress replica itself
listens on `--port`, and everything the ingress does over HTTP still holds there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import openai
import pytest

from raydix.deploy.config import AppConfig
from raydix.deploy.direct_ingress import direct_ingress_env, use_direct_ingress

from .conftest import MODEL_NAME, free_port
from .test_cli import UNCOMPILED_FLAGS, session_processes

pytestmark = [pytest.mark.ray, pytest.mark.slow]

API_KEY = "secret-key"


def test_direct_ingress_only_where_one_port_holds_the_ingress() -> None:
    assert use_direct_ingress(AppConfig())
    assert not use_direct_ingress(AppConfig(disable_direct_ingress=True))
    assert not use_direct_ingress(AppConfig(ingress_replicas=2))  # one port, one server
    assert not use_direct_ingress(AppConfig(address="auto"))  # its controller's own settings
    env = direct_ingress_env(8000)
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
            env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == ("8000", "8001")  # [min, max)


class Server(NamedTuple):
    proc: subprocess.Popen[bytes]
    url: str
    port: int
    log: Path


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """`raydix serve` of the tiny model, compiling nothing at start: what the module checks
    (where HTTP is served, and what the ingress does there) does not depend on how a decode
    is computed; test_cli.py's SIGINT start serves with the compiled code."""
    port = free_port()
    log = tmp_path_factory.mktemp("direct-ingress") / "serve.log"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    with log.open("wb") as out:  # a file, not a pipe: nobody reads the log while tests run
        proc = subprocess.Popen(
            [sys.executable, "-m", "raydix.deploy.cli", "serve", "--model", str(tiny_llama),
             "--served-model-name", MODEL_NAME, "--port", str(port), "--max-total-tokens",
             "4096", "--device", "cpu", "--cpu-threads", "1", *UNCOMPILED_FLAGS,
             "--api-key", API_KEY, "--shutdown-timeout", "20"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while f"raydix is ready on http://127.0.0.1:{port}" not in log.read_text(errors="replace"):
            if proc.poll() is not None:
                pytest.fail(f"raydix serve exited with {proc.returncode}:\n"
                            f"{log.read_text(errors='replace')[-3000:]}")
            assert time.monotonic() < deadline, "no ready line"
            time.sleep(0.5)
        yield Server(proc, f"http://127.0.0.1:{port}", port, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for left in session_processes(proc.pid):
            os.kill(int(left.split()[0]), signal.SIGKILL)


def listener_of(port: int, sid: int) -> str:
    """The command line of the process of session `sid` that listens on TCP `port`."""
    pid = listener_pid(port, sid)
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() if pid else ""


def listener_pid(port: int, sid: int) -> str:
    """The pid of the process of session `sid` that listens on TCP `port` ("" if none)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for entry in session_processes(sid):
        pid = entry.split()[0]
        try:
            fds = {os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()}
        except OSError:  # ended meanwhile, or a descriptor closed while read
            continue
        if fds & inodes:
            return pid
    return ""


def metric(url: str, name: str) -> float:
    """The sum of `name` over its labels in /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_the_ingress_replica_listens_on_the_port(server: Server) -> None:
    owner = listener_of(server.port, server.proc.pid)
    # the one engine replica is its own ingress (engine_ingress.py), and it answers HTTP
    # itself, not Serve's proxy: no hop between
    assert "ServeReplica:raydix:EngineServer" in owner, owner
    assert "ProxyActor" not in owner


def test_the_ingress_replica_does_not_load_torch(server: Server) -> None:
    """The replica that serves HTTP computes nothing (its engine steps in the engine process):
    its tokenizer comes from the app's builder, pickled, and unpickling it loads no torch
    (loading it with AutoTokenizer there did: ~4 s of CPU)."""
    pid = listener_pid(server.port, server.proc.pid)
    assert pid
    assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()


def test_streams_errors_auth_and_metrics_over_direct_ingress(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    stream = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                       max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                      max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=4, stream=True,
                                          messages=[{"role": "user", "content": "hi"}])
    assert [c for c in chat][-1].choices[0].finish_reason == "length"

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0
                      ).models.list()
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="another-model", prompt="x", max_tokens=2)
    assert refused.value.code == "model_not_found"
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    assert metric(server.url, "raydix_requests_total") >= 3
    assert metric(server.url, "raydix_kv_capacity_tokens") == 4096


def test_a_client_that_goes_away_aborts_its_request(server: Server) -> None:
    body = {"model": MODEL_NAME, "prompt": "Count: one, two,", "max_tokens": 2000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    before = metric(server.url, "raydix_engine_generated_tokens_total")
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line).startswith("data: {")
        assert metric(server.url, "raydix_requests_in_flight") == 1
    # the connection is closed here, mid-stream; /metrics may be a heartbeat (1 s) behind
    deadline = time.monotonic() + 30
    while (metric(server.url, "raydix_requests_in_flight") != 0
           or metric(server.url, "raydix_engine_generated_tokens_total") == before):
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.2)
    time.sleep(2.5)  # beyond a heartbeat: an engine still generating would show it
    generated = metric(server.url, "raydix_engine_generated_tokens_total") - before
    assert 3 <= generated < 1000  # stopped long before max_tokens


def test_sigterm_finishes_the_stream_and_leaves_no_process(server: Server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    stream = client.completions.create(model=MODEL_NAME, prompt="Count: one, two,",
                                       max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)  # mid-stream
    rest = [chunk.choices[0].finish_reason for chunk in chunks]
    assert rest[-1] == "length"  # the stream in flight ran to its end
    assert server.proc.wait(timeout=90) == 0, server.log.read_text(errors="replace")[-3000:]
    assert time.monotonic() - start < 30  # no 30 s draining period of Serve's default
    assert "direct ingress" in server.log.read_text(errors="replace")
    assert session_processes(server.proc.pid) == []
