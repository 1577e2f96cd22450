"""The router bench's workloads, as sessions of token-id prompts.

A session is a list of prompts sent one after another (each when the previous one has
finished); the workloads of one-shot requests are sessions of one prompt. Arrivals are either
Poisson (sessions start at a rate, whatever is in flight) or a closed loop (a fixed number of
sessions in flight).

- ``tenants``: multi-tenant under cache pressure (llm-d's shape, scaled down). Each tenant has
  a long shared context; its users ask short questions. The contexts together fill about
  ``pressure`` of the cluster's KV pools, so a replica can hold only its share of them.
- ``zipf``: prefix groups with Zipf-distributed popularity; the hottest group gets more requests
  than one replica computes alone.
- ``sessions``: multi-turn conversations whose context grows each turn (the previous prompt,
  an assistant reply and a new user message), interleaved so each is revisited after other
  traffic. The reply appended is synthetic: the next prompt's cacheable prefix is the previous
  prompt, not the tokens the replica generated.

``ideal_hit_rate``: the share of prompt tokens an infinite cache with perfect routing would
serve, each prompt's longest prefix shared with any earlier prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = (100, 40_000)


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: list[list[list[int]]]
    max_tokens: int  # output tokens per request
    note: str  # one line for the tables

    @property
    def prompts(self) -> list[list[int]]:
        return [p for s in self.sessions for p in s]

    @property
    def max_prompt_len(self) -> int:
        return max(len(p) for p in self.prompts)


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(*VOCAB, n).tolist()


def tenants(cluster_kv: int, pressure: float = 0.75, context: int = 1024, users: int = 6,
            question: int = 32, max_tokens: int = 8, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    num = max(round(pressure * cluster_kv / context), 2)
    contexts = [_ids(rng, context) for _ in range(num)]
    order = rng.permutation(np.repeat(np.arange(num), users))
    sessions = [[contexts[t] + _ids(rng, question)] for t in order]
    return Workload("tenants", sessions, max_tokens,
                    f"{num} tenants x {context}-token contexts ({num * context / cluster_kv:.0%} "
                    f"of the cluster's KV), {users} {question}-token questions each")


def zipf(groups: int = 16, requests: int = 96, prefix: int = 512, question: int = 32,
         s: float = 1.1, max_tokens: int = 8, seed: int = 1) -> Workload:
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, groups + 1) ** s
    picks = rng.choice(groups, size=requests, p=weights / weights.sum())
    prefixes = [_ids(rng, prefix) for _ in range(groups)]
    sessions = [[prefixes[g] + _ids(rng, question)] for g in picks]
    hottest = float(np.bincount(picks, minlength=groups).max()) / requests
    return Workload("zipf", sessions, max_tokens,
                    f"{groups} groups of a {prefix}-token prefix, Zipf s={s:g} over {requests} "
                    f"requests (hottest: {hottest:.0%} of them)")


def sessions(num: int = 24, turns: int = 4, first: int = 384, user: int = 64, reply: int = 16,
             max_tokens: int = 8, seed: int = 2) -> Workload:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        prompt = _ids(rng, first)
        turns_of = [prompt]
        for _ in range(turns - 1):
            prompt = prompt + _ids(rng, reply) + _ids(rng, user)
            turns_of.append(prompt)
        out.append(turns_of)
    return Workload("sessions", out, max_tokens,
                    f"{num} conversations x {turns} turns, {first}-token opening, +{reply + user} "
                    f"tokens a turn (last prompt {len(out[0][-1])} tokens)")


def ideal_hit_rate(prompts: list[list[int]]) -> float:
    """Each prompt's longest prefix shared with an earlier one, over all prompt tokens."""
    seen: set[int] = set()  # a hash per prefix held
    hit = total = 0
    for p in prompts:
        h, held = 0, 0
        prefix_hashes = []
        for t in p:
            h = hash((h, t))
            prefix_hashes.append(h)
        while held < len(p) and prefix_hashes[held] in seen:  # held prefixes are closed
            held += 1
        hit += held
        total += len(p)
        seen.update(prefix_hashes)
    return hit / max(total, 1)
