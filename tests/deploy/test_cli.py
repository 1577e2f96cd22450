"""`raydix serve`: flags and YAML into one config, one-line errors, and a real start and stop."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from raydix.deploy import engine_settings
from raydix.deploy.cli import build_parser, load_config, local_cpus_needed, main
from raydix.deploy.config import AppConfig, AutoscalingSettings
from raydix.deploy.cpu_threads import default_cpu_threads
from raydix.deploy.engine_settings import engine_config

from .conftest import MODEL_NAME, free_port

# `raydix serve` compiling nothing at start: neither the CPU decode graph nor the compiled
# decode attention
UNCOMPILED_FLAGS = ["--disable-cpu-decode-graph", "--disable-cpu-compiled-attention"]


def parse(*argv: str) -> AppConfig:
    return load_config(build_parser().parse_args(["serve", *argv]))


def test_flags_become_the_config() -> None:
    config = parse("--model", "/models/x", "--tp", "2", "--replicas", "3", "--port", "9000",
                   "--page-size", "16", "--schedule-policy", "lpm", "--disable-radix-cache",
                   "--mem-fraction-static", "0.7", "--api-key", "k")
    assert (config.model, config.tp, config.replicas, config.port) == ("/models/x", 2, 3, 9000)
    assert (config.page_size, config.schedule_policy) == (16, "lpm")
    assert config.disable_radix_cache and config.mem_fraction_static == 0.7
    assert config.api_key == "k" and config.host == "127.0.0.1"
    assert config.model_name == "x"
    assert parse() == AppConfig()


def test_router_flags_pick_the_request_router() -> None:
    from raydix.deploy.app import request_router_options
    from raydix.deploy.cli import ConfigError
    from raydix.deploy.engine_settings import routing_policy
    from raydix.router.policy import RoutingPolicyConfig
    from raydix.router.serve_router import CacheAwareRequestRouter, RoundRobinRequestRouter

    config = parse("--cache-threshold", "0.7", "--balance-abs-threshold", "8",
                   "--balance-rel-threshold", "2", "--saturated-kv-usage", "0.8",
                   "--router-decision-timeout-s", "0.2")
    assert config.router == "cache_aware"  # the default
    assert routing_policy(config) == RoutingPolicyConfig(
        mode="ttft", cache_threshold=0.7, balance_abs_threshold=8,
        balance_rel_threshold=2.0, saturated_kv_usage=0.8)
    options = request_router_options(config)["request_router_config"]
    assert options.get_request_router_class() is CacheAwareRequestRouter
    assert options.request_router_kwargs == {"decision_timeout_s": 0.2, "sole_replica": True}
    autoscaled = config.model_copy(update={"autoscaling": AutoscalingSettings(max_replicas=3)})
    assert request_router_options(autoscaled)["request_router_config"].request_router_kwargs[
        "sole_replica"] is False
    config = parse("--router", "round_robin")
    assert routing_policy(config) is None
    assert (request_router_options(config)["request_router_config"].get_request_router_class()
            is RoundRobinRequestRouter)
    assert request_router_options(parse("--router", "power_of_two")) == {}  # Serve's default
    for bad in (["--router", "random"], ["--cache-threshold", "1.5"],
                ["--balance-rel-threshold", "0.5"], ["--saturated-kv-usage", "0"]):
        with pytest.raises(ConfigError):
            parse(*bad)


def test_yaml_file_with_flags_on_top(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("tp: 2\nport: 9100\nautoscaling:\n  min_replicas: 1\n  max_replicas: 4\n")
    config = parse("--config", str(path), "--port", "9200")
    assert (config.tp, config.port) == (2, 9200)
    assert config.autoscaling is not None and config.autoscaling.max_replicas == 4


def test_local_ray_reserves_a_cpu_per_replica_and_rank() -> None:
    threads = default_cpu_threads(os.cpu_count() or 1)
    assert local_cpus_needed(AppConfig()) == threads  # tp 1 on CPU: the replica's threads
    assert local_cpus_needed(AppConfig(cpu_threads=1, replicas=3)) == 3
    assert local_cpus_needed(AppConfig(tp=2)) == 3
    assert local_cpus_needed(AppConfig(tp=2, replicas=2)) == 6


def test_api_key_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from raydix.deploy.app import API_KEY_ENV, api_key_of

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_of(AppConfig()) is None
    monkeypatch.setenv(API_KEY_ENV, "sk-env")
    assert api_key_of(AppConfig()) == "sk-env"
    assert api_key_of(AppConfig(api_key="sk-flag")) == "sk-flag"


def test_example_yaml_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "serve-example.yaml"
    config = parse("--config", str(example))
    assert config.schedule_policy == "lpm" and config.port == 8000


def test_serve_run_builder_takes_typed_args(smollm2: Path) -> None:
    """`serve run raydix.deploy.app:build_app k=v` goes through this Serve function."""
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from raydix.deploy.app import build_app

    app = call_user_app_builder_with_args_if_necessary(
        build_app, {"model": str(smollm2), "tp": "1", "device": "cpu"})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="tp"):
        call_user_app_builder_with_args_if_necessary(build_app, {"tp": 0})


def test_engine_config_from_app_config(smollm2: Path) -> None:
    app = AppConfig(model=str(smollm2), page_size=4, max_running_requests=8,
                    chunked_prefill_size=256, schedule_policy="lpm", disable_radix_cache=True,
                    mem_fraction_static=0.5, max_context_len=300)
    engine = engine_config(app, str(smollm2), "cpu")
    assert engine.worker.page_size == engine.scheduler.page_size == 4
    assert engine.worker.max_running_requests == engine.scheduler.max_running_requests == 8
    assert engine.worker.max_context_len == engine.scheduler.max_context_len == 300
    assert engine.scheduler.chunked_prefill_size == 256
    assert engine.scheduler.schedule_policy == "lpm"
    assert not engine.scheduler.enable_prefix_cache
    assert engine.worker.mem_fraction_static == 0.5
    assert engine.worker.cpu_decode_graph and engine.worker.cpu_compiled_attention  # defaults
    off = engine_config(parse("--model", str(smollm2), *UNCOMPILED_FLAGS), str(smollm2), "cpu")
    assert not (off.worker.cpu_decode_graph or off.worker.cpu_compiled_attention)

def test_the_step_budget_follows_the_device(smollm2: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU step of 8,192 prompt tokens lasts seconds, a GPU's tens of milliseconds; on CPU
    a step takes about a second at most: 512 tokens, or 2,048 where bf16 runs natively (AMX
    tiles or AVX-512-BF16)."""
    plain, fp32 = AppConfig(model=str(smollm2)), AppConfig(model=str(smollm2), dtype="float32")

    def budget(app: AppConfig, device: str) -> tuple[int, int]:
        scheduler = engine_config(app, str(smollm2), device).scheduler
        return scheduler.max_prefill_tokens, scheduler.chunked_prefill_size

    for native in (False, True):
        monkeypatch.setattr(engine_settings, "native_bf16", lambda native=native: native)
        assert budget(plain, "cpu") == ((2048, 2048) if native else (512, 512))
        assert budget(fp32, "cpu") == (512, 512)  # fp32 computes a 2,048-token step for seconds
        assert budget(plain, "cuda") == (8192, 2048)
    explicit = AppConfig(model=str(smollm2), max_prefill_tokens=1024, chunked_prefill_size=256)
    assert budget(explicit, "cpu") == (1024, 256)  # the flags win


@pytest.mark.parametrize(("argv", "named"), [
    (["--tp", "0"], "tp"),
    (["--port", "http"], "port"),
    (["--schedule-policy", "random"], "schedule_policy"),
    (["--mem-fraction-static", "1.5"], "mem_fraction_static"),
    (["--device", "tpu"], "device"),
])
def test_bad_flag_is_one_line(argv: list[str], named: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raydix serve: error:") and "\n" not in err
    assert named in err


def test_bad_yaml_key_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("tp: 1\nmax_batch: 4\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "max_batch" in err and "\n" not in err
    assert main(["serve", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_missing_model_folder_is_one_line(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err.strip()
    assert "no config.json" in err and "\n" not in err


def test_a_port_in_use_is_refused_in_one_line(smollm2: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(smollm2), "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert f"can't listen on 127.0.0.1:{port}" in err and "\n" not in err


def test_a_stop_signal_taken_by_another_thread_still_stops_the_server() -> None:
    """The kernel may hand `kill`'s signal to any thread that does not block it; the main
    thread, asleep while the server serves, must still run the handler (within a second)."""
    probe = ("import signal, threading, time\n"
             "from raydix.deploy.cli import _catch_stop_signals, wait_for_stop\n"
             "_catch_stop_signals()\n"
             "def other():\n"
             "    time.sleep(0.3)\n"
             "    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)\n"
             "threading.Thread(target=other).start()\n"
             "start = time.monotonic()\n"
             "try:\n"
             "    wait_for_stop()\n"
             "except KeyboardInterrupt:\n"
             "    print('stopped after', round(time.monotonic() - start, 1))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=30, check=True)
    assert out.stdout.startswith("stopped after"), out.stdout + out.stderr
    assert float(out.stdout.split()[-1]) < 3


def session_processes(sid: int) -> list[str]:
    """The live processes of session `sid` (a server started with start_new_session leads its
    own session, and so do all that it started, Ray's included), as "pid name"."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        fields = rest.split()
        if int(fields[3]) == sid and fields[0] != "Z":  # session id; zombies hold nothing
            found.append(f"{entry.name} {name}")
    return found


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize(("signum", "flags"), [
    (signal.SIGINT, []),
    # how a replica computes does not bear on how the server stops: this start compiles
    # nothing (7-8 s of the replica's start here, more on a first start), and checks that
    # the two switches reach the replica
    (signal.SIGTERM, ["--disable-direct-ingress", *UNCOMPILED_FLAGS]),
], ids=["SIGINT", "SIGTERM-through-the-proxy"])
def test_serve_answers_and_stops_cleanly_on_a_signal(smollm2: Path, signum: int,
                                                      flags: list[str]) -> None:
    """Ctrl-C and `kill` stop alike: the stream in flight finishes within the grace period,
    the process exits 0, and nothing it started (Ray's processes included) is left. Served
    by the ingress replica itself (the default) and through Serve's proxy; SIGTERM with the
    former is `test_direct_ingress.py`'s. The SIGINT start keeps `raydix serve`'s defaults
    on CPU (the paged decode kernel and the CPU decode graph)."""
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "raydix.deploy.cli", "serve", "--model", str(smollm2),
         "--served-model-name", MODEL_NAME, "--port", str(port), "--max-total-tokens", "2048",
         "--device", "cpu", "--cpu-threads", "1", "--shutdown-timeout", "20", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # its own session: what it leaves behind can be found
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    try:
        deadline = time.monotonic() + 120
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if f"raydix is ready on http://127.0.0.1:{port}" in line:
                break
            assert time.monotonic() < deadline, "no ready line"
        else:
            pytest.fail(f"raydix serve exited with {proc.wait()}")
        assert any("KV pool 2,048 tokens" in line for line in lines), "".join(lines)[-3000:]
        # the defaults on CPU: the paged decode kernel built at start, and a lone decode token
        # runs the compiled graph (the other serving tests turn both off)
        compiled = not flags
        for started in ("paged decode kernel for", "CPU decode graph ready in"):
            assert any(started in line for line in lines) == compiled, "".join(lines)[-3000:]
        # the engine steps in a process of its own (the session's processes below include it)
        assert any("1 CPU thread(s) in engine process" in line for line in lines), lines
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        out = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                        max_tokens=3, temperature=0)
        assert out.choices[0].text.startswith(" Paris")
        stream = client.completions.create(model=MODEL_NAME, prompt="Count: one, two,",
                                           max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        proc.send_signal(signum)  # mid-stream
        rest = [chunk.choices[0].finish_reason for chunk in chunks]
        assert rest[-1] == "length"  # the stream in flight ran to its end
        tail, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, tail[-3000:]
        assert "shutting down" in tail
        assert "SIGTERM received" not in tail  # not Ray's native handler
        assert session_processes(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for left in session_processes(proc.pid):
            os.kill(int(left.split()[0]), signal.SIGKILL)
