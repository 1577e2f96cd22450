"""Reading a transformers config field by field, so that nothing in it is silently ignored.

`ConfigFields` wraps the `to_dict()` of the transformers config class an architecture names
(transformers itself turns legacy spellings such as `rope_scaling` into today's fields). The
parser `take`s each field it implements; `finish` then refuses every other field of that class
whose value differs from the class default, naming field and value, except the ones in `INERT`,
which do not change what inference computes. Keys the class does not define (transformers
ignores them too) are logged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from ..config import RopeConfig

logger = logging.getLogger(__name__)

# fields that do not change inference: bookkeeping, training-only settings, token ids that the
# engine reads elsewhere (bos/pad) or never needs (unk: a tokenizer's, which transformers' GGUF
# conversion writes into config.json), and ones transformers derives into fields we do read
INERT = frozenset({
    "_name_or_path", "architectures", "transformers_version", "model_type", "dtype",
    "torch_dtype", "output_hidden_states", "output_attentions", "return_dict", "id2label",
    "label2id", "problem_type", "chunk_size_feed_forward", "use_cache", "initializer_range",
    "pad_token_id", "bos_token_id", "unk_token_id", "attention_dropout", "resid_pdrop", "embd_pdrop",
    "pretraining_tp",  # splits the matmuls the same way; transformers 5 no longer reads it
    "use_sliding_window", "max_window_layers",  # folded into sliding_window and layer_types
    "_sliding_window_pattern",  # folded into layer_types
})
# fields outside the class that change the weights or the forward
REFUSED_KEYS = ("quantization_config",)

ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")


class ConfigFields:
    def __init__(self, architecture: str, values: Mapping[str, object],
                 defaults: Mapping[str, object], class_fields: frozenset[str]) -> None:
        self.architecture = architecture
        self.values = dict(values)
        self.defaults = dict(defaults)
        self.class_fields = class_fields
        self.taken: set[str] = set()

    def take(self, name: str) -> object:
        """The value of a field the parser implements (None when absent)."""
        self.taken.add(name)
        return self.values.get(name)

    def refuse(self, name: str, why: str) -> ValueError:
        return ValueError(f"{self.architecture}: config field {name}={self.values.get(name)!r} "
                          f"is not supported: {why}")

    def finish(self) -> None:
        unknown = []
        for name, value in self.values.items():
            if name in self.taken or name in INERT:
                continue
            if name in REFUSED_KEYS:
                raise self.refuse(name, "raydix loads unquantized safetensors weights only")
            if name not in self.class_fields:
                unknown.append(name)
            elif value != self.defaults.get(name):
                raise self.refuse(name, f"it changes the model and raydix implements only "
                                        f"its default {self.defaults.get(name)!r}")
        if unknown:
            logger.warning("%s: config fields %s are not read by transformers' config class "
                           "either; ignored", self.architecture, sorted(unknown))


def as_int(fields: ConfigFields, name: str) -> int:
    value = fields.take(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise fields.refuse(name, "an integer is required")
    return value


def as_float(fields: ConfigFields, name: str) -> float:
    value = fields.take(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise fields.refuse(name, "a number is required")
    return float(value)


def optional_cap(fields: ConfigFields, name: str) -> float:
    """A soft cap (None or a positive number); 0.0 means none."""
    value = fields.take(name)
    if value is None:
        return 0.0
    if not isinstance(value, (int, float)) or value <= 0:
        raise fields.refuse(name, "a soft cap must be a positive number or null")
    return float(value)


def activation(fields: ConfigFields, name: str) -> str:
    value = fields.take(name)
    if value not in ACTIVATIONS:
        raise fields.refuse(name, f"supported activations: {ACTIVATIONS}")
    return str(value)


def layer_windows(fields: ConfigFields, num_layers: int, per_layer: bool) -> tuple[int, ...]:
    """Each layer's window: `sliding_window` on every layer, or (`per_layer`) on the layers
    that `layer_types` calls "sliding_attention"."""
    window = fields.take("sliding_window")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise fields.refuse("sliding_window", "a window must be a positive integer or null")
    if not per_layer:
        return (int(window or 0),) * num_layers
    types = fields.take("layer_types")
    if not isinstance(types, list) or len(types) != num_layers:
        raise fields.refuse("layer_types", f"one entry per layer ({num_layers}) is required")
    for t in types:
        if t not in LAYER_TYPES:
            raise fields.refuse("layer_types", f"supported layer types: {LAYER_TYPES}")
    if "sliding_attention" in types and window is None:
        raise fields.refuse("sliding_window", "sliding_attention layers need a window")
    return tuple(int(window or 0) if t == "sliding_attention" else 0 for t in types)


_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"},
    "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor",
               "high_freq_factor"},
}


def rope_config(fields: ConfigFields, params: object, max_position_embeddings: int,
                field: str = "rope_parameters",
                original_max_position_embeddings: int | None = None) -> RopeConfig:
    """One rope parameter mapping (transformers' standardized `rope_parameters`) as a
    `RopeConfig`, with the defaults transformers fills in resolved the way it resolves them."""
    if not isinstance(params, Mapping):
        raise fields.refuse(field, "a mapping of rope parameters is required")
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise fields.refuse(field, f"rope_type {rope_type!r}; supported: {ROPE_TYPES}")
    known = _ROPE_KEYS[rope_type] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    extra = sorted(set(params) - known)
    if extra:
        raise fields.refuse(field, f"rope parameters {extra} are not implemented for "
                                   f"rope_type {rope_type!r}")

    def number(key: str, default: float | None = None) -> float:
        value = params.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise fields.refuse(field, f"{rope_type} needs a number for {key!r}")
        return float(value)

    theta, partial = number("rope_theta", 10000.0), number("partial_rotary_factor", 1.0)
    if rope_type == "default":
        return RopeConfig("default", theta, partial)
    orig = int(number("original_max_position_embeddings",
                      float(original_max_position_embeddings or 0)))
    if rope_type == "dynamic":  # transformers scales against max_position_embeddings
        orig = max_position_embeddings
    if not orig and rope_type != "linear":
        raise fields.refuse(field, f"rope_type {rope_type!r} needs "
                                   "original_max_position_embeddings")
    if params.get("factor") is None and rope_type in ("yarn", "longrope"):
        factor = max_position_embeddings / orig
    else:
        factor = number("factor")
    if rope_type == "llama3":
        return RopeConfig("llama3", theta, partial, factor, orig,
                          low_freq_factor=number("low_freq_factor"),
                          high_freq_factor=number("high_freq_factor"))
    if rope_type == "yarn":
        mscale, mscale_all = number("mscale", 0.0), number("mscale_all_dim", 0.0)
        if params.get("attention_factor") is not None:
            attention = number("attention_factor")
        elif mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
        return RopeConfig("yarn", theta, partial, factor, orig,
                          beta_fast=float(params.get("beta_fast") or 32),
                          beta_slow=float(params.get("beta_slow") or 1),
                          mscale=mscale, mscale_all_dim=mscale_all,
                          truncate=bool(params.get("truncate", True)),
                          attention_factor=attention)
    if rope_type == "longrope":
        if params.get("attention_factor") is not None:
            attention = number("attention_factor")
        else:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        short, long = params.get("short_factor"), params.get("long_factor")
        if not isinstance(short, list) or not isinstance(long, list):
            raise fields.refuse(field, "longrope needs short_factor and long_factor lists")
        return RopeConfig("longrope", theta, partial, factor, orig, attention_factor=attention,
                          short_factor=tuple(float(x) for x in short),
                          long_factor=tuple(float(x) for x in long))
    return RopeConfig(rope_type, theta, partial, factor, orig)  # linear, dynamic


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
