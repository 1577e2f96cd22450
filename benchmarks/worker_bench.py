"""Worker speed on the default model, beside transformers' `generate` in the same run.

CPU (always): decode tokens/s at batch 1 and 16, prefill tokens/s; ours vs transformers.
CUDA (when available): decode at batch 1 and 32 with flashinfer + CUDA graphs, as a fraction of
the memory-bandwidth floor, (weight bytes + KV bytes read) / bandwidth.

    python benchmarks/worker_bench.py [--model FOLDER] [--decode-tokens 32] [--json out.json]
    python benchmarks/worker_bench.py --skip-cpu --synthetic llama-1b   # the floor's ~1B model

`--synthetic llama-1b` saves a randomly initialised Llama of TinyLlama-1.1B's shape (bf16) and
measures that: decode speed depends on the shapes, not the weights, and no hub is reachable.
`benchmarks/gpu_check.sh` runs every check that needs a CUDA machine.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from raydix.workers.config import WorkerConfig
from raydix.workers.gguf_convert import default_model_folder
from raydix.workers.runner import ModelRunner
from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan

# shapes of randomly initialised models for the bandwidth floor (no hub needed)
SYNTHETIC = {
    "llama-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                     max_position_embeddings=2048, tie_word_embeddings=False),
    # SmolLM2-135M's shape (the default model), for machines without its package
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True),
}

# peak memory bandwidth (GB/s) by device name fragment, for the floor
BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40": 864.0, "A10": 600.0}


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab - 1, size=(batch, prompt_len)).tolist()


class OurEngine:
    """Plans greedy steps for a fixed batch (rows 0..B-1, contiguous slots)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        reqs, slot = [], runner_page(self.runner)
        for i, p in enumerate(prompts):
            reqs.append(ScheduledRequest(i, 0, p, list(range(slot, slot + len(p))), GREEDY))
            slot += len(p)
        self._next_slot = slot
        self._lens = [len(p) for p in prompts]
        result = self.runner.step(StepPlan.build(0, reqs))
        assert result is not None
        return result.next_token_ids.tolist()

    def decode(self, tokens: list[int], steps: int) -> None:
        for s in range(steps):
            reqs = []
            for i, t in enumerate(tokens):
                reqs.append(ScheduledRequest(i, self._lens[i], [t], [self._next_slot], GREEDY))
                self._next_slot += 1
                self._lens[i] += 1
            result = self.runner.step(StepPlan.build(s + 1, reqs))
            assert result is not None
            tokens = result.next_token_ids.tolist()


def runner_page(runner: ModelRunner) -> int:
    return runner.kv_pool.config.page_size


def _timed(fn: Callable[[], object], sync: bool) -> float:
    if sync:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if sync:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_ours(runner: ModelRunner, batch: int, prompt_len: int, decode_tokens: int,
               vocab: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s)."""
    sync = runner.device.type == "cuda"
    engine = OurEngine(runner)
    prompts = _prompts(batch, prompt_len, vocab)
    engine.prefill(prompts)  # warm-up
    engine.decode([1] * batch, 2)
    first: list[int] = []
    t_prefill = _timed(lambda: first.extend(engine.prefill(prompts)), sync)
    t_decode = _timed(lambda: engine.decode(first, decode_tokens), sync)
    return batch * prompt_len / t_prefill, batch * decode_tokens / t_decode


def bench_hf(model: torch.nn.Module, batch: int, prompt_len: int, decode_tokens: int,
             vocab: int, device: str) -> tuple[float, float]:
    sync = device.startswith("cuda")
    ids = torch.tensor(_prompts(batch, prompt_len, vocab), device=device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> None:
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)

    gen(2)  # warm-up
    with torch.inference_mode():
        t_prefill = _timed(lambda: model(ids, attention_mask=mask), sync)
    t_one = _timed(lambda: gen(1), sync)
    t_all = _timed(lambda: gen(decode_tokens + 1), sync)
    return batch * prompt_len / t_prefill, batch * decode_tokens / max(t_all - t_one, 1e-9)


def cpu_report(folder: Path, decode_tokens: int, prompt_len: int) -> list[dict[str, object]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(WorkerConfig(str(folder), dtype="float32", max_running_requests=32,
                                      max_context_len=prompt_len + decode_tokens + 16,
                                      max_total_tokens=40_000))
    vocab = runner.model_config.vocab_size
    rows = []
    for batch in (1, 16):
        ours_p, ours_d = bench_ours(runner, batch, prompt_len, decode_tokens, vocab)
        hf_p, hf_d = bench_hf(hf, batch, prompt_len, decode_tokens, vocab, "cpu")
        rows.append({"device": "cpu", "batch": batch, "prompt_len": prompt_len,
                     "ours_prefill_tok_s": round(ours_p, 1), "hf_prefill_tok_s": round(hf_p, 1),
                     "ours_decode_tok_s": round(ours_d, 1), "hf_decode_tok_s": round(hf_d, 1)})
        print(f"cpu batch {batch:2d}: decode {ours_d:8.1f} tok/s (transformers {hf_d:8.1f}) | "
              f"prefill {ours_p:8.1f} tok/s (transformers {hf_p:8.1f})", flush=True)
    return rows


def synthetic_model(name: str, root: Path) -> Path:
    """A random model of the named shape, saved once under `root` as bf16 safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = root / f"synthetic-{name}"
    if (folder / "config.json").exists():
        return folder
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SYNTHETIC[name])).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    return folder


def decode_weight_bytes(runner: ModelRunner) -> int:
    """Weight bytes one decode step reads: every parameter but the embedding table, of which
    only the batch's rows are read (the LM head is its own tensor, tied or not)."""
    return sum(p.nbytes for name, p in runner.model.named_parameters()
               if name != "model.embed_tokens.weight")


def cuda_report(folder: Path, decode_tokens: int, prompt_len: int,
                bandwidth_gbs: float | None) -> list[dict[str, object]]:
    from transformers import AutoModelForCausalLM

    name = torch.cuda.get_device_name()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    if bandwidth_gbs is None:
        bandwidth_gbs = next((v for k, v in BANDWIDTH_GBS.items() if k in name), None)
    rows = []
    for batch in (1, 32):
        runner = ModelRunner(WorkerConfig(
            str(folder), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
            cuda_graph=True, cuda_graph_max_batch=32, max_running_requests=64,
            max_context_len=prompt_len + decode_tokens + 16, max_total_tokens=200_000))
        _, tok_s = bench_ours(runner, batch, prompt_len, decode_tokens,
                              runner.model_config.vocab_size)
        step_s = batch / tok_s
        _, hf_tok_s = bench_hf(hf, batch, prompt_len, decode_tokens,
                               runner.model_config.vocab_size, "cuda")
        mc = runner.model_config
        kv_bytes = (batch * (prompt_len + decode_tokens / 2) * mc.num_layers * 2
                    * mc.num_kv_heads * mc.head_dim * 2)
        floor_s = ((decode_weight_bytes(runner) + kv_bytes) / (bandwidth_gbs * 1e9)
                   if bandwidth_gbs else None)
        frac = floor_s / step_s if floor_s else None
        rows.append({"device": name, "batch": batch, "ours_decode_tok_s": round(tok_s, 1),
                     "hf_decode_tok_s": round(hf_tok_s, 1), "step_ms": round(step_s * 1e3, 3),
                     "floor_ms": round(floor_s * 1e3, 3) if floor_s else None,
                     "fraction_of_floor": round(frac, 3) if frac else None})
        print(f"{name} batch {batch:2d}: decode {tok_s:9.1f} tok/s (transformers "
              f"{hf_tok_s:9.1f}), step {step_s * 1e3:.3f} ms"
              + (f", floor {floor_s * 1e3:.3f} ms ({frac:.0%} of floor)" if frac else ""),
              flush=True)
        del runner
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="model folder (default: SmolLM2-135M-Instruct, converted once)")
    parser.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None,
                        help="measure a random model of this shape instead (saved under "
                             "--synthetic-root)")
    parser.add_argument("--synthetic-root", type=Path, default=Path("/tmp/raydix-bench"))
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="peak memory bandwidth for the CUDA floor (default: by device name)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.synthetic:
        folder = synthetic_model(args.synthetic, args.synthetic_root)
    else:
        folder = args.model or default_model_folder()
    rows = []
    if not args.skip_cpu:
        rows += cpu_report(folder, args.decode_tokens, args.prompt_len)
    if torch.cuda.is_available():
        rows += cuda_report(folder, args.decode_tokens, args.prompt_len, args.bandwidth_gbs)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
