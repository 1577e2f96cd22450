"""Config parsers of the mixture-of-experts architectures (Mixtral, Qwen2-MoE, Qwen3-MoE) and of
DeepSeek-V2/V3 (latent attention + experts), in the registry's form: `parse(fields, common)`
returns the common `ModelConfig` with the rest filled in (models/registry.py).

Fields that only matter for training (the router's auxiliary loss, its jitter noise, returning
router logits) are taken and left unused.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..config import MLAConfig, ModelConfig, MoEConfig
from .config_fields import ConfigFields, as_float, as_int, layer_windows, rope_config

_TRAINING_ONLY = ("router_aux_loss_coef", "output_router_logits", "router_jitter_noise",
                  "aux_loss_alpha", "seq_aux", "ep_size")


def _training_only(f: ConfigFields) -> None:
    for name in _TRAINING_ONLY:
        f.take(name)


def _sparse_every(f: ConfigFields, num_layers: int) -> tuple[bool, ...]:
    """Qwen's rule: experts on every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
    step = as_int(f, "decoder_sparse_step")
    dense = f.take("mlp_only_layers") or []
    if step < 1 or not isinstance(dense, list):
        raise f.refuse("decoder_sparse_step", "a positive step and a list of dense layers")
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def mixtral(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    _training_only(f)
    num_layers = c.num_layers
    moe = MoEConfig(num_experts=as_int(f, "num_local_experts"),
                    top_k=as_int(f, "num_experts_per_tok"),
                    intermediate_size=c.intermediate_size,
                    sparse_layers=(True,) * num_layers, renormalize=True)
    return replace(c, rope=rope_config(f, f.take("rope_parameters"), c.max_position_embeddings),
                   layer_windows=layer_windows(f, num_layers, False), moe=moe)


def qwen2_moe(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    _training_only(f)
    num_layers = c.num_layers
    shared = as_int(f, "shared_expert_intermediate_size")
    if shared < 1:
        raise f.refuse("shared_expert_intermediate_size", "Qwen2-MoE always has a shared expert")
    moe = MoEConfig(num_experts=as_int(f, "num_experts"), top_k=as_int(f, "num_experts_per_tok"),
                    intermediate_size=as_int(f, "moe_intermediate_size"),
                    sparse_layers=_sparse_every(f, num_layers),
                    renormalize=bool(f.take("norm_topk_prob")),
                    shared_intermediate_size=shared, shared_expert_gate=True)
    if f.values.get("sliding_window") == 0:  # Qwen2-MoE's default: no window
        f.values["sliding_window"] = None
    return replace(c, rope=rope_config(f, f.take("rope_parameters"), c.max_position_embeddings),
                   qkv_bias=bool(f.take("qkv_bias")),
                   layer_windows=layer_windows(f, num_layers, True), moe=moe)


def qwen3_moe(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    _training_only(f)
    num_layers = c.num_layers
    f.take("num_experts")  # the class's name for num_local_experts
    moe = MoEConfig(num_experts=as_int(f, "num_local_experts"),
                    top_k=as_int(f, "num_experts_per_tok"),
                    intermediate_size=as_int(f, "moe_intermediate_size"),
                    sparse_layers=_sparse_every(f, num_layers),
                    renormalize=bool(f.take("norm_topk_prob")))
    bias = bool(f.take("attention_bias"))
    return replace(c, rope=rope_config(f, f.take("rope_parameters"), c.max_position_embeddings),
                   qkv_bias=bias, o_bias=bias, qk_norm=True,
                   layer_windows=layer_windows(f, num_layers, False), moe=moe)


def _expect(f: ConfigFields, name: str, allowed: tuple[object, ...], why: str) -> object:
    value = f.take(name)
    if value not in allowed:
        raise f.refuse(name, why)
    return value


def _deepseek(f: ConfigFields, c: ModelConfig, v3: bool) -> ModelConfig:
    _training_only(f)
    num_layers = c.num_layers
    for name in ("attention_bias", "mlp_bias"):
        _expect(f, name, (False, None), "DeepSeek checkpoints have no such biases")
    # keys of the original checkpoints' configs that transformers' class does not define: only
    # the values transformers itself implements are accepted
    _expect(f, "moe_layer_freq", (1, None), "experts on every layer after the dense ones only")
    for name in ("num_nextn_predict_layers", "num_mtp_layers"):
        f.take(name)  # multi-token-prediction layers: not run, not loaded
    f.take("qk_head_dim")  # derived: qk_nope_head_dim + qk_rope_head_dim
    if v3:
        _expect(f, "topk_method", ("noaux_tc", None), "DeepSeek-V3 routes with noaux_tc")
        _expect(f, "scoring_func", ("sigmoid", None), "DeepSeek-V3 scores with a sigmoid")
        num_groups, topk_group = as_int(f, "n_group"), as_int(f, "topk_group")
        renormalize = bool(f.take("norm_topk_prob"))
        scoring, bias = "sigmoid", True
        interleave = bool(f.take("rope_interleave"))
    else:
        method = _expect(f, "topk_method", ("greedy", "group_limited_greedy"),
                         "DeepSeek-V2 routes with greedy or group_limited_greedy")
        _expect(f, "scoring_func", ("softmax", None), "DeepSeek-V2 scores with a softmax")
        _expect(f, "norm_topk_prob", (False, None),
                "transformers' DeepSeek-V2 never renormalizes the top-k weights")
        grouped = method == "group_limited_greedy"
        num_groups = as_int(f, "n_group") if grouped else 1
        topk_group = as_int(f, "topk_group") if grouped else 1
        if not grouped:
            f.take("n_group")
            f.take("topk_group")
        renormalize, scoring, bias, interleave = False, "softmax", False, True
    moe_size = as_int(f, "moe_intermediate_size")
    first_dense = as_int(f, "first_k_dense_replace")
    num_shared = f.take("n_shared_experts")
    f.take("n_routed_experts")
    scaling = as_float(f, "routed_scaling_factor")
    moe = None
    # no top-k: every layer dense (a checkpoint with experts then fails to load, by name)
    if f.take("num_experts_per_tok") is not None:
        moe = MoEConfig(num_experts=as_int(f, "n_routed_experts"),
                        top_k=as_int(f, "num_experts_per_tok"), intermediate_size=moe_size,
                        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
                        scoring=scoring, renormalize=renormalize, routed_scaling_factor=scaling,
                        num_groups=num_groups, topk_group=topk_group, correction_bias=bias,
                        shared_intermediate_size=moe_size * int(num_shared or 0),  # type: ignore[call-overload]
                        router_fp32=True)
    rope = rope_config(f, f.take("rope_parameters"), c.max_position_embeddings)
    q_lora = f.take("q_lora_rank")
    nope, rope_dim = as_int(f, "qk_nope_head_dim"), as_int(f, "qk_rope_head_dim")
    if c.head_dim != rope_dim:
        raise f.refuse("head_dim", f"DeepSeek rotates qk_rope_head_dim={rope_dim} dimensions")
    scale = (nope + rope_dim) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:  # yarn: transformers' mscale
        mscale = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
        scale *= mscale * mscale
    mla = MLAConfig(q_lora_rank=None if q_lora is None else int(q_lora),  # type: ignore[call-overload]
                    kv_lora_rank=as_int(f, "kv_lora_rank"), qk_nope_head_dim=nope,
                    qk_rope_head_dim=rope_dim, v_head_dim=as_int(f, "v_head_dim"),
                    rope_interleave=interleave)
    return replace(c, rope=rope, moe=moe, mla=mla, attn_scale=scale)


def deepseek_v2(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    return _deepseek(f, c, v3=False)


def deepseek_v3(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    return _deepseek(f, c, v3=True)
