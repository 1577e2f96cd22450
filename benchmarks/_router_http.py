"""The router bench's HTTP side: deploy one app per router, send a workload, measure it.

Per run: hit rate (usage ``cached_tokens / prompt_tokens``), output throughput over the wall
time, TTFT mean / p90 / p99, and the load spread: the busiest replica's share of the prompt
tokens computed (not served from cache) over the mean replica's (1.0 is even), and the output
tokens per engine step (over all replicas: fewer is the same work in more, smaller batches),
read from the replicas' counters on /metrics before and after the run; and the CPU seconds each
part of the stack used during the run (engines, ingress, proxy, router, client: `cpu_by_role`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import numpy as np
from _router_workloads import Workload

_COUNTER = re.compile(r'^raydix_engine_(prompt_tokens|cached_tokens|finished_requests|steps)_total'
                      r'\{replica="([^"]+)"\} ([0-9.e+]+)$', re.M)
_TRACED = re.compile(r'^raydix_(?:engine_)?(prompt_tokens_total|cached_tokens_total|'
                     r'num_running_requests|num_waiting_requests|kv_used_tokens)'
                     r'\{replica="([^"]+)"\} ([0-9.e+]+)$', re.M)
TRACE_PERIOD_S = 0.5
# a Ray worker's title (``ray::<actor class or task>``) -> its role in the bench's tables
_ROLES = (("EngineServer", "engines"), ("OpenAIIngress", "ingress"), ("ProxyActor", "proxy"),
          ("RouterActor", "router"), ("PrefixTreeActor", "router"),
          ("StatsBoard", "stats board"))


def cpu_by_role() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this machine's Ray workers, by role, each with
    its own child processes (an engine replica's engine process); the bench's own process is
    the client. Read before and after a run: what each part of the stack spent on it."""
    import os

    import psutil

    def seconds(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return float(times.user + times.system)

    out = {"client": seconds(psutil.Process(os.getpid()))}
    for proc in psutil.process_iter(["cmdline"]):
        title = (proc.info["cmdline"] or [""])[0]
        if not title.startswith("ray::") or title.startswith("ray::IDLE"):
            continue
        role = next((r for key, r in _ROLES if key in title), "other Ray workers")
        try:
            own = [proc] + [c for c in proc.children(recursive=True)
                            if not (c.cmdline() or [""])[0].startswith("ray::")]
            out[role] = out.get(role, 0.0) + sum(seconds(p) for p in own)
        except psutil.Error:  # ended while read
            continue
    return out


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
               ) -> tuple[float, int, int, int]:
    """(time to first token, prompt tokens, cached tokens, output tokens) of one request."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = float("nan")
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft != ttft:
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return (ttft, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens", 0)),
            int(usage.get("completion_tokens", 0)))


async def _counters(client: httpx.AsyncClient, url: str) -> dict[tuple[str, str], float]:
    text = (await client.get(url + "/metrics")).text
    return {(name, replica): float(v) for name, replica, v in _COUNTER.findall(text)}


async def _trace(client: httpx.AsyncClient, url: str, t0: float,
                 rows: list[dict[str, Any]]) -> None:
    """Every `TRACE_PERIOD_S`: per replica its prompt and cached token counters, running and
    waiting requests and KV tokens in use, as /metrics shows them."""
    while True:
        text = (await client.get(url + "/metrics")).text
        row: dict[str, Any] = {"t": round(time.perf_counter() - t0, 2)}
        for name, replica, v in _TRACED.findall(text):
            row.setdefault(replica[-6:], {})[name.split("_")[1 if "num" in name else 0]] = \
                float(v)
        rows.append(row)
        await asyncio.sleep(TRACE_PERIOD_S)


async def _run(url: str, workload: Workload, concurrency: int | None, rate: float | None,
               seed: int, trace: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Closed loop: `concurrency` sessions in flight. Open loop: sessions start at `rate` per
    second (Poisson). A session's prompts go one after another."""
    n = len(workload.sessions)
    starts = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)) if rate else None
    sem = asyncio.Semaphore(concurrency or n)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        before = await _counters(client, url)
        cpu_before = cpu_by_role()
        t0 = time.perf_counter()
        poller = asyncio.create_task(_trace(client, url, t0, trace)) if trace is not None \
            else None

        async def session(i: int, prompts: list[list[int]]) -> list[tuple[float, int, int, int]]:
            if starts is not None:
                await asyncio.sleep(max(float(starts[i]) - (time.perf_counter() - t0), 0.0))
            async with sem:
                return [await _one(client, url, p, workload.max_tokens) for p in prompts]

        done = await asyncio.gather(*(session(i, s) for i, s in enumerate(workload.sessions)))
        wall = time.perf_counter() - t0
        cpu_after = cpu_by_role()
        if poller is not None:
            poller.cancel()
        await asyncio.sleep(1.5)  # the replicas' stats reach the board about once a second
        after = await _counters(client, url)
    results = [r for s in done for r in s]
    ttft = np.array([r[0] for r in results])
    prompt_tokens = sum(r[1] for r in results)
    computed: dict[str, float] = {}
    for (name, replica), value in after.items():
        if name in ("prompt_tokens", "cached_tokens"):
            delta = value - before.get((name, replica), 0.0)
            computed[replica] = computed.get(replica, 0.0) + (delta if name == "prompt_tokens"
                                                                 else -delta)
    loads = np.array(list(computed.values()) or [0.0])
    steps = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "steps")
    output_tokens = sum(r[3] for r in results)
    return {"hit_rate": sum(r[2] for r in results) / max(prompt_tokens, 1),
            "throughput": output_tokens / wall,
            "ttft_mean": float(np.nanmean(ttft)), "ttft_p90": float(np.nanpercentile(ttft, 90)),
            "ttft_p99": float(np.nanpercentile(ttft, 99)),
            "spread": float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0,
            "wall_s": wall, "requests": float(len(results)),
            # the engines' steps over the run: few tokens a step is many small batches
            "steps": steps, "tokens_per_step": output_tokens / steps if steps else 0.0,
            # CPU seconds each part of the stack spent during the run (the machine's, by role)
            "cpu_s": {role: round(cpu_after[role] - cpu_before.get(role, 0.0), 2)
                      for role in cpu_after},
            **({"per_request": [[round(r[0], 3), r[2]] for r in results]} if trace is not None
               else {})}


def run_workload(url: str, workload: Workload, concurrency: int | None, rate: float | None,
                 seed: int = 7, trace: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``trace``: a list to append the replicas' state to, twice a second, and the results then
    carry each request's (TTFT, cached tokens) in session order."""
    return asyncio.run(_run(url, workload, concurrency, rate, seed, trace))


def warm_up(url: str, replicas: int) -> None:
    """A few short requests with nothing in common (model start-up off the clock)."""
    rng = np.random.default_rng(99)
    prompts = [rng.integers(100, 40_000, 8).tolist() for _ in range(2 * replicas)]
    w = Workload("warm-up", [[p] for p in prompts], 1, "")
    run_workload(url, w, replicas, None)
