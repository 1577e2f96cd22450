"""The per-rank model runner: model shard, KV pool, request->token table, backend, sampler."""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .attention import (
    AttentionBackend,
    ForwardBatch,
    TorchAttentionBackend,
    block_causal,
    make_backend,
    paged_decode,
)
from .config import ModelConfig, WorkerConfig
from .cpu_decode_graph import BATCHED_DTYPES, CpuDecodeGraph, wanted
from .cpu_features import native_bf16
from .cpu_step_graph import CpuStepGraph
from .cpu_step_graph import serves as step_graph_serves
from .device import resolve_device
from .double_sparse import make_double_sparse
from .grammar import GrammarCompiler, GrammarTable
from .graph_head import head_packed, layers_packed
from .host_kv_pool import check_copies, make_host_pool
from .host_memory import keep_freed_memory
from .kv_pool import KVPool, KVPoolConfig, MLAKVPool
from .kv_prefault import KVPrefault
from .layers import packed_gemv, small_gemm
from .layers.embedding import ParallelLMHead
from .layers.fused import fused_ops_for
from .layers.packed import (
    pack_linear_layers,
    packed_linear_weights,
    packing_supported,
    plain_linear_weights,
    rank_dtype,
    weight_bytes,
)
from .loader import load_model
from .parallel import SINGLE_RANK, TPGroup, all_gather_ints, all_reduce_min, head_shard
from .penalties import PenaltyTracker
from .pending_step import PendingStep, SampledTokens, input_ids_on_device, unpack_result
from .pool_sizing import (
    pool_cell,
    profile_max_num_tokens,
    step_headroom,
)
from .req_table import RequestTable, to_device
from .sampler import Sampler
from .sampling_table import SamplingTable
from .step import SamplingParams, StepPlan, StepResult
from .vec_isa import settle_vector_isa
from .warmup import WarmUpResult, warm_up

if TYPE_CHECKING:  # imported lazily: CUDA graphs need CUDA and flashinfer
    from .cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs `StepPlan`s on one rank. Every rank of a replica runs every plan (SPMD); rank 0
    samples and returns the `StepResult`, the others return None."""

    def __init__(self, config: WorkerConfig, group: TPGroup = SINGLE_RANK) -> None:
        if (group.tp_rank, group.tp_size) != (config.tp_rank, config.tp_size):
            raise ValueError(f"group is rank {group.tp_rank} of {group.tp_size} but the config "
                             f"says rank {config.tp_rank} of {config.tp_size}")
        self.config = config
        self.group = group
        self.device = resolve_device(config.device)  # "cuda" gets its index: the current device
        if config.cuda_graph and (self.device.type != "cuda"
                                  or config.attention_backend != "flashinfer"):
            raise ValueError("cuda_graph=True needs device='cuda' and attention_backend="
                             "'flashinfer'")
        if self.device.type == "cpu" and config.cpu_keep_freed_memory:
            keep_freed_memory()  # no page faults on each layer's activations (host_memory.py)
        self.model_config = ModelConfig.from_folder(config.model_path)
        mc = self.model_config
        dtype = rank_dtype(config, mc, group)
        self.dtype = dtype
        self.model = load_model(config.model_path, mc, group, dtype, self.device)
        # the fused steps (norms, rope, activations, K/V writes) go with the attention backend:
        # flashinfer's kernels beside flashinfer's attention, plain torch otherwise
        self.fused_ops = fused_ops_for(
            "fused" if config.attention_backend == "flashinfer" else "torch")
        self.model.use_fused_ops(self.fused_ops)
        self.decode_graph: CpuDecodeGraph | None = None
        use_graph = config.cpu_decode_graph and self.device.type == "cpu" and wanted(
            self.model, config.kv_pool, config.tp_size)
        if use_graph:
            settle_vector_isa()  # before inductor's first compile in this process
        if self.device.type == "cpu" and config.cpu_packed_linear:
            if packing_supported(self.device, dtype):
                if not use_graph or layers_packed(dtype):  # (native bf16: graph_head.py)
                    pack_linear_layers(self.model, config.max_running_requests)  # the only copy
                    if dtype == torch.float32:  # how many rows its few-row kernel takes here
                        packed_gemv.tune_f32(packed_linear_weights(self.model))
                else:  # the graph reads the decoder layers' weights plain
                    if head_packed(self.model, dtype):
                        pack_linear_layers(self.model, config.max_running_requests,
                                           ParallelLMHead)
                    if small_gemm.warm_up():  # their products of a few rows (small_gemm.py)
                        small_gemm.tune(plain_linear_weights(self.model), dtype)
            else:
                logger.warning("linear layers run unpacked in %s: oneDNN packing covers float32, "
                               "and bfloat16 where the CPU has native bf16 (avx512_bf16 or amx; "
                               "native here: %s)", dtype, native_bf16())
        self.weight_bytes = weight_bytes(self.model)

        heads = head_shard(mc.num_heads, mc.num_kv_heads, config.tp_rank, config.tp_size)
        pool_heads, pool_dim, cell = pool_cell(mc, config, heads, dtype)
        self.headroom = step_headroom(mc, config, dtype, heads.num_q_heads + 2 * heads.num_kv_heads,
                                      self.device.type == "cuda")
        free, total = self._memory_reading()
        num_tokens = profile_max_num_tokens(
            all_gather_ints(free, group), all_reduce_min(total, group),
            config.mem_fraction_static, cell, config.page_size, config.max_total_tokens,
            self.headroom)
        pool_config = KVPoolConfig(num_tokens // config.page_size, config.page_size,
                                   mc.num_layers, pool_heads, pool_dim, dtype)
        self.kv_pool: KVPool | MLAKVPool  # the double-sparse pool is made with its backend
        if config.kv_pool == "auto":
            self.kv_pool = (KVPool(pool_config, self.device) if mc.mla is None
                            else MLAKVPool(pool_config, self.device))
        self.table = RequestTable(config.max_running_requests, config.max_context_len,
                                  pool_config.num_slots, self.device)
        self.req_to_token = self.table.table  # [max_running_requests, max_context_len] int32
        self.backend: AttentionBackend
        if config.kv_pool == "double-sparse":
            self.kv_pool, self.backend = make_double_sparse(
                config, mc, pool_config, heads, self.req_to_token, self.model,
                self.model.layer_attention(), self.device)
        else:
            self.backend = make_backend(
                config.attention_backend, self.kv_pool, self.req_to_token, heads.num_q_heads,
                mc.head_dim, self.model.layer_attention(), mc.mla, config.cuda_graph_plan)
        if isinstance(self.kv_pool, KVPool):
            self.kv_pool.ops = self.fused_ops
        self.host_pool = (make_host_pool(config, self.kv_pool, self.group, self.device)
                          if config.host_tier else None)
        self.kv_prefault = (KVPrefault(self.kv_pool.buffers)
                            if self.device.type == "cpu" and config.cpu_prefault_kv else None)
        if (isinstance(self.backend, TorchAttentionBackend) and self.device.type == "cpu"
                and config.cpu_compiled_attention):
            self.backend.paged_kernel = paged_decode.warm_up(
                heads.num_kv_heads, mc.head_dim, mc.num_heads // mc.num_kv_heads, dtype)
        if (isinstance(self.backend, TorchAttentionBackend) and self.device.type == "cpu"
                and self.backend.block_causal and dtype == torch.bfloat16):
            block_causal.warm_up()  # the row blocks' softmax kernel
        self.sampler = Sampler(self.device)
        self.penalties = PenaltyTracker(mc.vocab_size, self.device)  # driving rank only
        # the tokens the last step sampled, on the device: the next plan's placeholders
        self._sampled: SampledTokens | None = None
        self._no_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        self.sampling_table = SamplingTable()  # driving rank only
        self.grammars = GrammarTable(  # driving rank only; xgrammar loads on the first grammar
            GrammarCompiler(config.model_path, mc.vocab_size, mc.eos_token_ids), self.device)
        if use_graph and isinstance(self.kv_pool, KVPool):
            self.decode_graph = CpuDecodeGraph(self.model, self.kv_pool, self.req_to_token,
                                               batched=dtype in BATCHED_DTYPES)
            logger.info("CPU decode graph: compiling (about 45 s on 2 cores the first time on "
                        "this machine for SmolLM2-135M; later starts load it from inductor's "
                        "cache in a few seconds)")
            logger.info("CPU decode graph ready in %.1f s", self.decode_graph.warm_up())
        self.step_graph: CpuStepGraph | None = None
        if (self.decode_graph is not None and config.cpu_step_graph and step_graph_serves(dtype)
                and isinstance(self.backend, TorchAttentionBackend)
                and isinstance(self.kv_pool, KVPool)):
            self.step_graph = CpuStepGraph(self.model, self.kv_pool, self.backend)
            logger.info("CPU step graph ready in %.1f s", self.step_graph.warm_up())
        self.warm_up: WarmUpResult | None = None
        if config.warm_up:  # before the graphs: eager kernels compile first, then are captured
            self.warm_up = warm_up(self.model, self.backend, self.req_to_token, self.device)
        self.graph_runner: CudaGraphRunner | None = None
        if config.cuda_graph:
            self.graph_runner = self._capture_graphs()

    def _capture_graphs(self) -> CudaGraphRunner:
        from .attention.flashinfer_backend import FlashInferAttentionBackend
        from .cuda_graph import CudaGraphRunner

        if not isinstance(self.backend, FlashInferAttentionBackend):
            raise TypeError("CUDA graphs need the flashinfer backend")
        return CudaGraphRunner(self.model, self.backend, self.config.graph_max_batch,
                               self.config.max_context_len, self.device)

    @property
    def max_host_tokens(self) -> int:
        """Usable host KV slots (0 without a host tier)."""
        return self.host_pool.max_num_tokens if self.host_pool is not None else 0

    @property
    def max_num_tokens(self) -> int:
        """Usable KV slots; the engine's allocator has `max_num_tokens // page_size` pages."""
        return self.kv_pool.config.max_num_tokens

    def prefault_kv(self, in_use: int) -> bool:
        """Populate the next chunk of the CPU KV pool ahead of use (no slot from `in_use` up has
        been handed out yet); False when there is nothing to do (kv_prefault.py)."""
        return self.kv_prefault is not None and self.kv_prefault.step(in_use)

    def _memory_reading(self) -> tuple[int, int]:
        """(free bytes after weights, total bytes) of this rank's device."""
        if self.device.type == "cuda":
            gc.collect()  # an engine built before in this process (cycles) gives its memory back
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free), int(total)
        budget = self.config.cpu_memory_budget_bytes
        return budget - self.weight_bytes, budget

    # ---- the step ---------------------------------------------------------------------------

    def check_plan(self, plan: StepPlan) -> None:
        """Raise ValueError for a plan outside the table or the pool. The driving rank calls
        this before broadcasting, so a bad plan never reaches the followers."""
        self.table.check(plan)
        check_copies(self.host_pool, plan)
        if self.config.tp_rank == 0:
            self.sampling_table.check(plan)

    def step(self, plan: StepPlan, checked: bool = False) -> StepResult | None:
        """Run the plan and wait for its result (rank 0; None on the others)."""
        pending = self.launch(plan, checked)
        return None if pending is None else pending.result()

    def takes_pending_on_device(self, plan: StepPlan) -> bool:
        """Whether this rank reads the plan's placeholders on the device (`pending_step.py`),
        so that nothing on the host waits for the step before. The host needs the tokens when
        other ranks share the plan, and when penalties or grammars count them."""
        return (self.config.tp_size == 1 and not self.penalties.num_tracked
                and not plan.penalty_starts and not self.grammars.num_active
                and not plan.grammar_starts)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, checked: bool = False) -> PendingStep | None:
        """Apply the plan's table diffs, queue the forward and (rank 0) the sampling and its
        device->host copy; returns at once on CUDA (rank 0: the pending result; else None).
        `checked`: the driving rank ran `check_plan` on this plan already."""
        if not checked:
            self.check_plan(plan)
        if self.host_pool is not None:  # the host tier's copies come before the forward
            self.host_pool.apply(plan.device_to_host, plan.host_to_device)
        if self.config.tp_rank == 0:
            # the sampling state follows the plan (freed rows too: an empty plan may carry
            # them) before the forward, so that the grammars' masks are made beside it
            self.penalties.update(plan)
            sampling = self.sampling_table.update(plan)
            self.grammars.update(plan, sampling)
            if plan.batch_size and self.grammars.num_active:
                self.grammars.prepare(plan, sampling)
        if plan.batch_size == 0:
            self.table.apply(plan)
        else:
            logits = self.forward(plan, checked=True)
        if self.config.tp_rank != 0:
            return None
        if plan.batch_size == 0:
            self._sampled = SampledTokens(plan.step_id, self._no_tokens)
            return PendingStep.done(self._empty_result(plan))
        seq_lens = plan.prefix_lens.astype(np.int64) + plan.extend_lens
        check = self.grammars if self.grammars.num_active and self.grammars.draws_first else None
        out = self.sampler.sample(logits, sampling, seq_lens,
                                  self._logit_processors(plan, sampling), check)
        self._sampled = SampledTokens(plan.step_id, out.token_ids)
        rows = [out.token_ids.double()[None]]  # token ids are exact in float64
        if out.logprobs is not None:
            rows.append(out.logprobs.double()[None])
        if out.top is not None:
            rows += [out.top[0].double().T, out.top[1].double().T]
        finish = functools.partial(unpack_result, plan, sampling, out.logprobs is not None,
                                   0 if out.top is None else out.top[0].shape[1],
                                   self.grammars.ended if self.grammars.num_active else None)
        return PendingStep.copy(torch.cat(rows), finish)  # the step's one device->host copy

    def _logit_processors(self, plan: StepPlan, sampling: tuple[SamplingParams, ...]
                          ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The penalties, then the grammars' token bitmask, as one map of the logits."""
        steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
        if self.penalties.num_tracked:
            steps.append(functools.partial(self.penalties.apply, plan=plan, sampling=sampling))
        if self.grammars.num_active:
            steps.append(functools.partial(self.grammars.apply, plan=plan))
        if not steps:
            return None
        return functools.reduce(lambda f, g: lambda x: g(f(x)), steps)

    @torch.inference_mode()
    def forward(self, plan: StepPlan, checked: bool = False) -> torch.Tensor:
        """Logits [B, vocab] of each request's last new token (also used by tests)."""
        if not checked:
            self.table.check(plan)
        self.table.apply(plan)
        batch = self._make_batch(plan)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        if self.decode_graph is not None and self.decode_graph.can_run(batch):
            return self.decode_graph.replay(batch)
        self.backend.prepare(batch)
        last = self._to_device(batch.token_starts + batch.extend_lens - 1)
        if self.step_graph is not None and self.step_graph.can_run(batch):
            return self.model.compute_logits(self.step_graph.forward(batch, last))
        hidden = self.model(batch.input_ids, batch.positions, self.backend)
        return self.model.compute_logits(hidden[last])

    def _make_batch(self, plan: StepPlan) -> ForwardBatch:
        prefix = plan.prefix_lens.astype(np.int64)
        extend = plan.extend_lens.astype(np.int64)
        starts = np.cumsum(extend) - extend
        positions = np.arange(int(extend.sum()), dtype=np.int64) + np.repeat(prefix - starts,
                                                                              extend)
        return ForwardBatch(
            row_idx=plan.row_idx.astype(np.int64), prefix_lens=prefix, extend_lens=extend,
            input_ids=input_ids_on_device(np.asarray(plan.input_ids, dtype=np.int64),
                                          plan.tokens_from_step, self._sampled, self.device),
            positions=self._to_device(positions),
            out_cache_loc=self._to_device(plan.out_cache_loc.astype(np.int64)),
            row_versions=self.table.versions[plan.row_idx])

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        return to_device(arr, self.device)

    @staticmethod
    def _empty_result(plan: StepPlan) -> StepResult:
        return StepResult(plan.step_id, np.zeros(0, np.int64), None, np.zeros(0, bool))
