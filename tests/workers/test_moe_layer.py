"""The mixture-of-experts layer against transformers' routers, the grouped expert loop against a
per-token loop (with experts that get no token), the latent pool's sizing rule, and the
config fields the MoE / MLA architectures refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

from raydix.workers.config import ModelConfig, MoEConfig, WorkerConfig
from raydix.workers.layers.moe import ExpertMLP, grouped_experts, select_experts
from raydix.workers.parallel import SINGLE_RANK
from raydix.workers.pool_sizing import mla_cell_size, profile_max_num_tokens
from raydix.workers.worker import TPWorker

from .moe_models import MOE_CONFIGS, save_moe_model

HIDDEN, EXPERTS = 32, 8


def _dense(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[T, E] routing weights (0 for experts not picked): independent of top-k order."""
    return torch.zeros(ids.shape[0], EXPERTS).scatter_(1, ids, weights.float())


def _hf_router(kind: str) -> tuple[torch.nn.Module, MoEConfig]:
    common = dict(hidden_size=HIDDEN, num_experts_per_tok=3)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=EXPERTS)
        return MixtralTopKRouter(cfg), MoEConfig(EXPERTS, 3, 16, (True,), renormalize=True)
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(**common, num_experts=EXPERTS, norm_topk_prob=False)
        return Qwen2MoeTopKRouter(cfg), MoEConfig(EXPERTS, 3, 16, (True,))
    if kind in ("v2_greedy", "v2_grouped"):
        grouped = kind == "v2_grouped"
        cfg = transformers.DeepseekV2Config(
            **common, n_routed_experts=EXPERTS, routed_scaling_factor=1.7,
            topk_method="group_limited_greedy" if grouped else "greedy",
            n_group=4 if grouped else None, topk_group=2 if grouped else None)
        return DeepseekV2TopkRouter(cfg), MoEConfig(
            EXPERTS, 3, 16, (True,), routed_scaling_factor=1.7, num_groups=4 if grouped else 1,
            topk_group=2 if grouped else 1)
    cfg = transformers.DeepseekV3Config(**common, n_routed_experts=EXPERTS, n_group=4,
                                        topk_group=2, routed_scaling_factor=2.5,
                                        norm_topk_prob=True)
    return DeepseekV3TopkRouter(cfg), MoEConfig(
        EXPERTS, 3, 16, (True,), scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5,
        num_groups=4, topk_group=2, correction_bias=True)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "v2_greedy", "v2_grouped", "v3"])
def test_routing_matches_transformers(kind: str) -> None:
    torch.manual_seed(0)
    router, config = _hf_router(kind)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
        bias = None
        if kind == "v3":
            router.e_score_correction_bias.normal_(0.0, 0.5)
            bias = router.e_score_correction_bias
    x = torch.randn(64, HIDDEN)
    _, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(F.linear(x, router.weight), config, bias)
    torch.testing.assert_close(_dense(weights, ids), _dense(hf_weights, hf_ids),
                               atol=1e-6, rtol=1e-6)
    if config.num_groups > 1:  # every token's experts lie in at most topk_group groups
        groups = ids // (EXPERTS // config.num_groups)
        assert all(len(set(g.tolist())) <= config.topk_group for g in groups)


def test_grouped_loop_equals_a_per_token_loop_and_skips_idle_experts() -> None:
    torch.manual_seed(1)
    experts = torch.nn.ModuleList(ExpertMLP(HIDDEN, 24, "silu", SINGLE_RANK)
                                  for _ in range(EXPERTS))
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    calls = [0] * EXPERTS
    for i, e in enumerate(experts):
        e.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    x = torch.randn(5, HIDDEN)
    ids = torch.tensor([[0, 2], [2, 5], [7, 0], [5, 2], [0, 7]])  # 1, 3, 4 and 6 get no token
    weights = torch.rand(5, 2)
    out = grouped_experts(x, weights, ids, experts)
    assert calls == [1, 0, 1, 0, 0, 1, 0, 1]  # one call per expert with tokens, none idle
    expected = torch.stack([sum(weights[t, k] * experts[int(ids[t, k])](x[t: t + 1])[0]
                                for k in range(2)) for t in range(5)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_latent_pool_is_sized_by_the_mla_cell(tmp_path: Path) -> None:
    save_moe_model("deepseek_v2", tmp_path)
    budget = 64 << 20
    worker = TPWorker(WorkerConfig(str(tmp_path), dtype="float32", max_running_requests=4,
                                   max_context_len=128, max_prefill_tokens=256, page_size=16,
                                   cpu_memory_budget_bytes=budget, warm_up=False))
    runner = worker.runner
    cell = mla_cell_size(16 + 8, 2, 4)  # (kv_lora_rank + qk_rope_head_dim) * layers * fp32
    assert cell == 192
    expected = profile_max_num_tokens([budget - runner.weight_bytes], budget, 0.85, cell, 16,
                                      None, runner.headroom)
    assert runner.max_num_tokens == expected > 0
    assert runner.kv_pool.num_bytes == (expected + 16) * cell  # + the padding page


def _raw(name: str, **fields: object) -> dict[str, object]:
    config_class, kwargs = MOE_CONFIGS[name]
    raw = getattr(transformers, config_class)(**{**kwargs, **fields}).to_dict()
    raw["architectures"] = [config_class.replace("Config", "ForCausalLM")]
    return raw


@pytest.mark.parametrize(("name", "field", "value", "message"), [
    ("deepseek_v2", "norm_topk_prob", True, "never renormalizes"),
    ("deepseek_v2", "topk_method", "noaux_tc", "greedy or group_limited_greedy"),
    ("deepseek_v2", "attention_bias", True, "no such biases"),
    ("deepseek_v3", "scoring_func", "softmax", "sigmoid"),
    ("deepseek_v3", "moe_layer_freq", 2, "every layer"),
])
def test_unsupported_fields_are_refused_by_name(name: str, field: str, value: object,
                                                message: str) -> None:
    raw = _raw(name)
    raw[field] = value
    with pytest.raises(ValueError, match=f"{field}={value!r}") as err:
        ModelConfig.from_dict(raw)
    assert message in str(err.value)


def test_latent_attention_refuses_other_backends(tmp_path: Path) -> None:
    save_moe_model("deepseek_v3", tmp_path)
    from raydix.workers.attention import make_backend
    from raydix.workers.kv_pool import KVPoolConfig, MLAKVPool

    mc = ModelConfig.from_folder(tmp_path)
    pool = MLAKVPool(KVPoolConfig(2, 1, 2, 1, 24, torch.float32), "cpu")
    with pytest.raises(ValueError, match="attention_backend 'flashinfer' has no latent"):
        make_backend("flashinfer", pool, torch.zeros(1, 4, dtype=torch.int32), 4, 8,
                     mla=mc.mla)


def test_correction_bias_stays_float32_in_a_bf16_model(tmp_path: Path) -> None:
    from safetensors import safe_open

    save_moe_model("deepseek_v3", tmp_path)
    worker = TPWorker(WorkerConfig(str(tmp_path), dtype="bfloat16", max_running_requests=2,
                                   max_context_len=64, max_total_tokens=256, warm_up=False))
    gate = worker.runner.model.model.layers[1].mlp.gate
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    stored = next(f.get_tensor(name) for path in sorted(tmp_path.glob("*.safetensors"))
                  for f in [safe_open(str(path), "pt")] if name in f.keys())  # noqa: SIM118
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(gate.e_score_correction_bias, stored.float())
    assert gate.weight.dtype == torch.bfloat16
