"""The supported architectures: the `architectures` entry of config.json -> how its config is
read, which model class runs it, and what it supports (the README's table is made from here).

Adding an architecture: a parse function that `take`s every field of its transformers config
class that the model implements (the config guard refuses the others), a model class, and an
entry in `ARCHITECTURES`; `tests/workers/test_config_guard.py` then checks that every field of
the class is read, inert or refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from ..config import ModelConfig, RopeConfig
from ..parallel import TPGroup
from .config_fields import (
    ROPE_TYPES,
    ConfigFields,
    activation,
    as_float,
    as_int,
    layer_windows,
    optional_cap,
    rope_config,
)
from .deepseek import DeepseekV2ForCausalLM
from .gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from .llama import LlamaForCausalLM
from .mixtral import LlamaMoEForCausalLM, MixtralForCausalLM
from .moe_configs import deepseek_v2, deepseek_v3, mixtral, qwen2_moe, qwen3_moe
from .phi3 import Phi3ForCausalLM

Parse = Callable[[ConfigFields, ModelConfig], ModelConfig]


@dataclass(frozen=True)
class Architecture:
    name: str  # the `architectures` entry
    config_class: str  # the transformers config class that reads its config.json
    model_class: type[LlamaForCausalLM]
    parse: Parse  # (fields, the common fields read) -> the whole ModelConfig
    features: str  # for the README


def _common(f: ConfigFields, arch: str, act_field: str) -> ModelConfig:
    """The fields every architecture has; the rope and the rest come from its parse."""
    hidden, heads = as_int(f, "hidden_size"), as_int(f, "num_attention_heads")
    num_layers = as_int(f, "num_hidden_layers")
    eos = f.take("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    kv_heads, head_dim = f.take("num_key_value_heads"), f.take("head_dim")
    return ModelConfig(
        architecture=arch, vocab_size=as_int(f, "vocab_size"), hidden_size=hidden,
        intermediate_size=as_int(f, "intermediate_size"), num_layers=num_layers,
        num_heads=heads, num_kv_heads=int(kv_heads) if isinstance(kv_heads, int) else heads,
        head_dim=int(head_dim) if isinstance(head_dim, int) else hidden // heads,
        rms_norm_eps=as_float(f, "rms_norm_eps"), hidden_act=activation(f, act_field),
        rope=RopeConfig(), max_position_embeddings=as_int(f, "max_position_embeddings"),
        tie_word_embeddings=bool(f.take("tie_word_embeddings")),
        eos_token_ids=tuple(int(e) for e in eos_ids if isinstance(e, int)),
        layer_windows=(0,) * num_layers)


def _rope(f: ConfigFields, c: ModelConfig, partial: bool = False) -> RopeConfig:
    original = None
    if partial:  # Phi-3 keeps its original length beside the rope parameters
        value = f.take("original_max_position_embeddings")
        original = value if isinstance(value, int) else None
    rope = rope_config(f, f.take("rope_parameters"), c.max_position_embeddings,
                       original_max_position_embeddings=original)
    if rope.partial_rotary_factor != 1.0 and not partial:
        raise f.refuse("rope_parameters", "partial_rotary_factor must be 1.0 for this "
                                          "architecture (transformers rotates whole heads)")
    return rope


def _llama(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    bias = bool(f.take("attention_bias"))
    return replace(c, rope=_rope(f, c), qkv_bias=bias, o_bias=bias,
                   mlp_bias=bool(f.take("mlp_bias")))


def _mistral(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    return replace(c, rope=_rope(f, c), layer_windows=layer_windows(f, c.num_layers, False))


def _qwen2(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    return replace(c, rope=_rope(f, c), qkv_bias=True,
                   layer_windows=layer_windows(f, c.num_layers, True))


def _qwen3(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    bias = bool(f.take("attention_bias"))
    return replace(c, rope=_rope(f, c), qkv_bias=bias, o_bias=bias, qk_norm=True,
                   layer_windows=layer_windows(f, c.num_layers, True))


def _phi3(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    return replace(c, rope=_rope(f, c, partial=True),
                   layer_windows=layer_windows(f, c.num_layers, False))


def _gemma(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    if f.take("use_bidirectional_attention"):
        raise f.refuse("use_bidirectional_attention", "raydix serves causal decoders only")
    bias = bool(f.take("attention_bias"))
    return replace(c, rope=_rope(f, c), qkv_bias=bias, o_bias=bias)


def _gemma2_attention(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    """Gemma 2 and 3: per-layer windows, `query_pre_attn_scalar`, soft caps."""
    return replace(c, layer_windows=layer_windows(f, c.num_layers, True),
                   attn_scale=as_float(f, "query_pre_attn_scalar") ** -0.5,
                   attn_logit_softcap=optional_cap(f, "attn_logit_softcapping"),
                   final_logit_softcap=optional_cap(f, "final_logit_softcapping"))


def _gemma2(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    return _gemma2_attention(f, _gemma(f, c))


def _gemma3(f: ConfigFields, c: ModelConfig) -> ModelConfig:
    if f.take("use_bidirectional_attention"):
        raise f.refuse("use_bidirectional_attention", "raydix serves causal decoders only")
    bias = bool(f.take("attention_bias"))
    params = f.take("rope_parameters")
    if not isinstance(params, dict) or set(params) != {"full_attention", "sliding_attention"}:
        raise f.refuse("rope_parameters", "Gemma 3 needs one entry per layer type")
    max_pos = c.max_position_embeddings
    c = replace(c, rope=rope_config(f, params["full_attention"], max_pos),
                local_rope=rope_config(f, params["sliding_attention"], max_pos),
                qkv_bias=bias, o_bias=bias, qk_norm=True)
    return _gemma2_attention(f, c)


_LLAMA = "GQA, tied embeddings, `attention_bias` (q/k/v/o), `mlp_bias`"
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "LlamaConfig", LlamaForCausalLM, _llama, _LLAMA),
    Architecture("MistralForCausalLM", "MistralConfig", LlamaForCausalLM, _mistral,
                 "sliding window on every layer (`sliding_window`)"),
    Architecture("Qwen2ForCausalLM", "Qwen2Config", LlamaForCausalLM, _qwen2,
                 "q/k/v bias; sliding window on the layers `layer_types` names "
                 "(`use_sliding_window`, `max_window_layers`)"),
    Architecture("Qwen3ForCausalLM", "Qwen3Config", LlamaForCausalLM, _qwen3,
                 "q/k RMSNorm, `attention_bias`; per-layer sliding window like Qwen2"),
    Architecture("Phi3ForCausalLM", "Phi3Config", Phi3ForCausalLM, _phi3,
                 "fused `qkv_proj` and `gate_up_proj` checkpoints, partial rotary, longrope, "
                 "sliding window on every layer"),
    Architecture("GemmaForCausalLM", "GemmaConfig", GemmaForCausalLM, _gemma,
                 "(1 + w) RMSNorm, embeddings scaled by sqrt(hidden), GELU-tanh MLP"),
    Architecture("Gemma2ForCausalLM", "Gemma2Config", Gemma2ForCausalLM, _gemma2,
                 "Gemma's, plus sandwich norms, attention and final logit soft-capping, "
                 "`query_pre_attn_scalar`, sliding window on alternate layers"),
    Architecture("Gemma3ForCausalLM", "Gemma3TextConfig", Gemma3ForCausalLM, _gemma3,
                 "Gemma 2's, plus q/k norms, local and global layers with their own rope "
                 "(`layer_types`, per-layer-type `rope_parameters`); text only"),
    Architecture("MixtralForCausalLM", "MixtralConfig", MixtralForCausalLM, mixtral,
                 "mixture of experts (softmax top-k, renormalized), sliding window"),
    Architecture("Qwen2MoeForCausalLM", "Qwen2MoeConfig", LlamaMoEForCausalLM, qwen2_moe,
                 "Qwen2's attention; experts with a sigmoid-gated shared expert, "
                 "`norm_topk_prob`, `decoder_sparse_step`, `mlp_only_layers`"),
    Architecture("Qwen3MoeForCausalLM", "Qwen3MoeConfig", LlamaMoEForCausalLM, qwen3_moe,
                 "Qwen3's attention; experts, `norm_topk_prob`, `decoder_sparse_step`, "
                 "`mlp_only_layers`"),
    Architecture("DeepseekV2ForCausalLM", "DeepseekV2Config", DeepseekV2ForCausalLM,
                 deepseek_v2, "latent attention (MLA pool; `q_lora_rank` or none), experts "
                 "with shared experts after `first_k_dense_replace` dense layers, softmax "
                 "greedy or group-limited routing"),
    Architecture("DeepseekV3ForCausalLM", "DeepseekV3Config", DeepseekV2ForCausalLM,
                 deepseek_v3, "DeepSeek-V2's, with sigmoid routing, correction bias and grouped "
                 "top-k (noaux_tc), `rope_interleave`"),
)}


def parse_model_config(raw: dict[str, object]) -> ModelConfig:
    """A `config.json` mapping as a `ModelConfig`, read through the architecture's transformers
    config class; raises ValueError for an unsupported architecture or field value."""
    return read_config(raw)[0]


def read_config(raw: dict[str, object]) -> tuple[ModelConfig, ConfigFields]:
    """`parse_model_config`, also returning the fields as read (which ones it took)."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ValueError("config.json has no 'architectures' entry")
    arch = ARCHITECTURES.get(str(archs[0]))
    if arch is None:
        raise ValueError(f"architecture {archs[0]!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)}")
    import transformers

    cls = getattr(transformers, arch.config_class)
    values = cls.from_dict(dict(raw)).to_dict()
    defaults = cls().to_dict()
    class_fields = frozenset(defaults) | frozenset(f.name for f in fields(cls))
    f = ConfigFields(arch.name, values, defaults, class_fields)
    act_field = "hidden_activation" if "hidden_activation" in class_fields else "hidden_act"
    config = arch.parse(f, _common(f, arch.name, act_field))
    f.finish()
    return config, f


def build_model(config: ModelConfig, group: TPGroup) -> LlamaForCausalLM:
    """Construct (on the current default device, e.g. meta) the model for `config`."""
    arch = ARCHITECTURES.get(config.architecture)
    if arch is None:
        raise ValueError(f"no model class for architecture {config.architecture!r}")
    return arch.model_class(config, group)


def supported_table() -> str:
    """The README's table of supported architectures (checked by a test)."""
    rows = ["| architecture | transformers config | what runs |", "|---|---|---|"]
    rows += [f"| `{a.name}` | `{a.config_class}` | {a.features} |"
             for a in ARCHITECTURES.values()]
    rows.append("")
    rows.append("Rope scaling (`rope_type`) on every architecture: "
                + ", ".join(f"`{t}`" for t in ROPE_TYPES) + ".")
    return "\n".join(rows)
