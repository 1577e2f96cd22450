"""DoubleSparse against dense attention on the default model: the mean log-likelihood of a fixed
text, fed one token per decode step after a short dense prefill, with a token budget of 1/8 of
the text's length (sparse decode from the first step). Both run in one process on the same
weights; prints both means and their difference. (It measures quality, not speed: the torch
decode path is a reference implementation, and the first model run pays its warm-up.)

    python benchmarks/double_sparse_bench.py [--channels 16] [--budget-fraction 0.125]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from transformers import AutoTokenizer

from raydix.workers.config import WorkerConfig
from raydix.workers.gguf_convert import default_model_folder
from raydix.workers.step import GREEDY, ScheduledRequest, StepPlan
from raydix.workers.worker import TPWorker

PREFILL = 32
TEXT = """\
A key-value cache keeps, for every token a model has already read, the keys and values its
attention layers computed, so that the next token costs one step instead of a pass over the
whole text. The cache grows with every token. For a long conversation or a long document it
becomes the largest thing in memory, larger than the weights, and reading it becomes the
largest part of the time each step takes. Two ideas make it cheaper. The first is to share it:
requests that begin with the same system prompt or the same document can point at the same
cached pages, which a radix tree over token ids finds in a few microseconds. The second is to
read less of it. Most of the attention weight of a query falls on a small part of the context:
the first tokens, the recent ones, and a few that matter to the question at hand. If those few
could be found cheaply, the query could attend over them alone and skip the rest.
Double sparsity finds them with a second, smaller cache. For every token it keeps only a few
channels of each key, the channels that carry most of the product between queries and keys in
this model. A query first scores every cached token on those channels alone, which reads a
small fraction of the keys, then keeps the best scored tokens and attends exactly over them.
When the budget covers the whole context the answer is the exact one; when it covers an eighth,
the answer is an approximation whose quality depends on how well the few channels predict the
full scores. Measuring that on real text, beside the exact answer, is the honest way to decide
whether the approximation is good enough for a given use. The same measurement also shows how
the choice of channels matters: channels picked on a calibration prompt from the magnitudes of
queries and keys tend to be the ones with large activations in every text, because a model's
outlier channels are a property of its weights more than of its inputs. Memory is the other
side of the trade. The labels cost a few channels per head and token, a small addition to the
pool, and the attention reads only them plus the chosen tokens, so the bytes read per step fall
with the budget. On a graphics card, where decoding is bound by memory bandwidth, that is where
the speed comes from; on a processor the gain depends on how the gathers are done.
"""


def log_likelihood(worker: TPWorker, ids: list[int]) -> float:
    """Mean log-probability of ids[PREFILL:] given the text before each."""
    slots = list(range(1, len(ids) + 1))
    plan = StepPlan.build(0, [ScheduledRequest(0, 0, ids[:PREFILL], slots[:PREFILL], GREEDY)])
    logits = worker.runner.forward(plan)
    total = 0.0
    for pos in range(PREFILL, len(ids)):
        total += float(torch.log_softmax(logits[0].float(), -1)[ids[pos]])
        plan = StepPlan.build(pos, [ScheduledRequest(0, pos, [ids[pos]], [slots[pos]],
                                                     GREEDY)])
        logits = worker.runner.forward(plan)
    return total / (len(ids) - PREFILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=16)
    parser.add_argument("--budget-fraction", type=float, default=0.125)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = str(default_model_folder())
    ids = AutoTokenizer.from_pretrained(folder)(TEXT).input_ids
    budget = max(1, int(len(ids) * args.budget_fraction))
    common = dict(dtype="float32", max_running_requests=1, max_context_len=len(ids) + 8,
                  max_total_tokens=len(ids) + 8, warm_up=False)
    dense = TPWorker(WorkerConfig(folder, **common))  # type: ignore[arg-type]
    sparse = TPWorker(WorkerConfig(folder, kv_pool="double-sparse",  # type: ignore[arg-type]
                                   ds_heavy_channel_num=args.channels, ds_heavy_token_num=budget,
                                   ds_sparse_decode_threshold=0, **common))
    ll_dense, ll_sparse = log_likelihood(dense, ids), log_likelihood(sparse, ids)
    print(f"default model, {len(ids)} tokens ({PREFILL} prefilled), budget {budget} tokens "
          f"({args.budget_fraction:g} of the text), {args.channels} heavy channels of 64, "
          f"channels from the calibration prompt, {args.threads} threads")
    print("| attention | mean log-likelihood | perplexity |")
    print("|---|---|---|")
    for name, ll in (("dense", ll_dense), ("double-sparse", ll_sparse)):
        print(f"| {name} | {ll:.4f} | {np.exp(-ll):.2f} |")
    print(f"difference (sparse - dense): {ll_sparse - ll_dense:+.4f} nats per token")


if __name__ == "__main__":
    main()
