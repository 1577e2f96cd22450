"""Tiny random mixture-of-experts and latent-attention models, saved as transformers saves them
(one safetensors tensor per expert projection), for the equality tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

_BASE = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256, initializer_range=0.15,
             rms_norm_eps=1e-6, tie_word_embeddings=False)
_MLA = dict(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, num_experts_per_tok=2)

# name -> (transformers config class, its arguments)
MOE_CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    # 4 experts, top-2 renormalized; GQA 4:2
    "mixtral": ("MixtralConfig", dict(_BASE, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2)),
    # 6 experts, top-2 not renormalized, a gated shared expert; layer 0 dense (mlp_only_layers)
    "qwen2_moe": ("Qwen2MoeConfig", dict(_BASE, num_key_value_heads=2, num_experts=6,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48,
                                         norm_topk_prob=False, mlp_only_layers=[0])),
    # q/k norms, top-2 renormalized, experts on every layer
    "qwen3_moe": ("Qwen3MoeConfig", dict(_BASE, num_key_value_heads=2, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         norm_topk_prob=True)),
    # q without a low-rank bottleneck, softmax routing over 4 of 8 groups... of 2 kept
    "deepseek_v2": ("DeepseekV2Config", dict(_BASE, **_MLA, q_lora_rank=None, n_routed_experts=8,
                                             topk_method="group_limited_greedy", n_group=4,
                                             topk_group=2, routed_scaling_factor=1.5)),
    # q_lora_rank set, sigmoid routing with correction bias over 2 of 4 groups, yarn rope
    "deepseek_v3": ("DeepseekV3Config", dict(
        _BASE, **_MLA, q_lora_rank=24, n_routed_experts=8, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1})),
}


def save_moe_model(name: str, folder: Path) -> None:
    """Build the named tiny model with random weights (norms and the correction bias too,
    which transformers starts at constants) and save it to `folder`."""
    config_class, kwargs = MOE_CONFIGS[name]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(2024)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.3)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="200KB")
