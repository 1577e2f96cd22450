"""Latent attention decode: reading only the latents (weight absorption) against expanding them
into per-head K and V, on a tiny random DeepSeek-V2-shaped model on the CPU.

Both modes run in one process on the same pool: requests are prefilled once, then decode steps
alternate between the modes (so machine noise hits both alike). Printed per mode: decode steps
per second and tokens per second, and the bytes of K/V the attention reads per step over all
layers: latents [B, L, r + dr] when absorbed; K [B, H, L, dn + dr] and V [B, H, L, dv] when
expanded. The expected factor is H (dn + dr + dv) / (r + dr).

    python benchmarks/mla_bench.py [--batch 8] [--context 1024] [--steps 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch
import transformers

from raydix.workers.config import WorkerConfig
from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan
from raydix.workers.worker import TPWorker

# DeepSeek-V2-Lite's attention widths, with fewer heads and layers
SHAPE = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
             num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4,
             num_experts_per_tok=2, first_k_dense_replace=2, max_position_embeddings=4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per mode")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    b, ctx = args.batch, args.context
    folder = tempfile.mkdtemp(prefix="mla-bench-")
    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(**SHAPE)
    transformers.DeepseekV2ForCausalLM(config).save_pretrained(folder)
    max_len = ctx + 2 * args.steps + 1
    worker = TPWorker(WorkerConfig(folder, dtype="float32", max_running_requests=b,
                                   max_context_len=max_len, max_total_tokens=b * max_len,
                                   max_prefill_tokens=b * ctx, warm_up=False))
    backend = worker.runner.backend
    rng = np.random.default_rng(0)
    slots = [list(range(1 + r * max_len, 1 + (r + 1) * max_len)) for r in range(b)]
    plan = StepPlan.build(0, [ScheduledRequest(r, 0, rng.integers(3, 1000, ctx).tolist(),
                                               slots[r][:ctx], GREEDY) for r in range(b)])
    tokens = worker.step(plan).next_token_ids
    seconds = {True: 0.0, False: 0.0}
    for step in range(2 * args.steps):
        absorb = step % 2 == 0
        backend.absorb_decode = absorb  # type: ignore[attr-defined]
        pos = ctx + step
        plan = StepPlan.build(step + 1, [ScheduledRequest(r, pos, [int(tokens[r])],
                                                          [slots[r][pos]], GREEDY)
                                         for r in range(b)])
        start = time.perf_counter()
        tokens = worker.step(plan).next_token_ids
        seconds[absorb] += time.perf_counter() - start
    h, m = SHAPE["num_attention_heads"], SHAPE
    layers, length = SHAPE["num_hidden_layers"], ctx + args.steps  # mean context length
    latent = m["kv_lora_rank"] + m["qk_rope_head_dim"]  # type: ignore[operator]
    expanded = h * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"] + m["v_head_dim"])  # type: ignore[operator]
    read = {True: b * length * latent * 4 * layers, False: b * length * expanded * 4 * layers}
    print(f"batch {b}, context {ctx}, {layers} layers, {h} heads, r={m['kv_lora_rank']}, "
          f"dr={m['qk_rope_head_dim']}, dn={m['qk_nope_head_dim']}, dv={m['v_head_dim']}, "
          f"{args.threads} threads")
    print("| decode | steps/s | tokens/s | K/V bytes read per step |")
    print("|---|---|---|---|")
    for absorb, name in ((False, "expand K/V"), (True, "latent only")):
        rate = args.steps / seconds[absorb]
        print(f"| {name} | {rate:.1f} | {rate * b:.0f} | {read[absorb] / 1e6:.1f} MB |")
    print(f"latent-only speed-up: {seconds[False] / seconds[True]:.2f}x; bytes read fall "
          f"{read[False] / read[True]:.2f}x (expected H(dn+dr+dv)/(r+dr) = "
          f"{expanded / latent:.2f})")


if __name__ == "__main__":
    main()
