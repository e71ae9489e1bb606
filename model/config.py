"""AttentionConfig: the one description of the model that every part of attnx shares."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from attnx.errors import ConfigError
from attnx.model.rope import Rope
from attnx.model.terms import (
    LLM_TERMS,
    TERMS,
    Latent,
    QKNorm,
    Temperature,
    check_int,
    check_number,
    projection_shapes,
    term_tensors,
    terms_of,
)

__all__ = ["AttentionConfig", "CacheSpec", "COMPRESSED_KV", "ROPE_KEY", "Latent", "QKNorm", "TensorSpec", "PRESETS", "preset", "load_config", "LLM_KEYS"]

# The keys of modern LLM attention (docs/concepts/formula.md, "Modern LLM attention"): absent or null, the formula is
# the one without them. A core that cannot express one refuses it by name (attnx.model.cores).
LLM_KEYS = tuple(key for name in LLM_TERMS for key in TERMS[name].keys)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, dtype name (a key of attnx.model.contract.DTYPES), shape with dim names."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


# the latent cache's parts (CacheSpec.parts): each token's turned rope key, its normed compressed kv
ROPE_KEY, COMPRESSED_KV = "rope_key", "compressed_kv"


@dataclasses.dataclass(frozen=True)
class CacheSpec(TensorSpec):
    """One tensor of a step model's cache, as its core lays it out (AttentionConfig.cache_specs): `role` ("key",
    "value", "latent") names it past_<role> in and present_<role> out (a whole model's own names: `pair`); batch first; `grows` is the dim a token
    adds a position to (2); the other dims are fixed sizes. Whatever allocates, feeds, binds or times a cache
    reads these, never per-head k and v."""

    role: str = ""
    grows: int = 2
    pair: tuple[str, str] | None = None  # (past input, present output) where a whole model names them its own way
    # the named column ranges of its last dim, in order, where it joins tensors another model keeps apart (the
    # latent: the rope key, then the compressed kv; a whole model's reader names its tensors by these): (name, width)
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def past(self) -> str:
        return self.pair[0] if self.pair else f"past_{self.role}"

    @property
    def present(self) -> str:
        return self.pair[1] if self.pair else f"present_{self.role}"

    def sized(self, batch: int, length: int) -> tuple[int, ...]:
        """The concrete shape of `batch` rows of `length` positions."""
        return tuple(batch if i == 0 else length if i == self.grows else int(d) for i, d in enumerate(self.shape))

    @property
    def token_values(self) -> int:
        """The values one position of one row holds (the fixed dims' product: n_kv_heads x head_dim; 1 x latent)."""
        return math.prod(int(d) for i, d in enumerate(self.shape) if i not in (0, self.grows))


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Multi-head attention: y = concat_n(softmax(scale * q k^T + mask) v) Wo + bo.

    head_dim defaults to d_model / n_heads, v_head_dim to head_dim and kv_dim (width of
    memory for cross-attention) to d_model. scale None means 1/sqrt(head_dim).
    """

    d_model: int
    n_heads: int
    head_dim: int | None = None
    v_head_dim: int | None = None
    kv_dim: int | None = None
    bias: bool = True
    causal: bool = False
    cross: bool = False
    key_padding_mask: bool = False
    scale: float | None = None
    # Decode (docs/concepts/step-forms.md): key/value heads shared
    # by groups of query heads (None: n_heads; 1: multi-query), and the step model's signature.
    n_kv_heads: int | None = None
    kv_cache: bool = False
    # Modern LLM attention (docs/concepts/formula.md, "Modern LLM attention"), in the formula's order: qk_norm, rope,
    # scale, softcap, masks (sliding_window), softmax with a sink logit per head.
    rope: Rope | None = None
    sliding_window: int | None = None
    softcap: float | None = None
    qk_norm: QKNorm | None = None
    sinks: bool = False
    # ALiBi (attnx.model.alibi): head h adds slope_h * (j - i) to the scores over token index, after
    # the scale and softcap, before the masks (BLOOM, MPT).
    alibi: bool = False
    # Llama 4 (attnx.model.terms): a weightless RMS norm of q and k after rope (its eps), q scaled by a temperature of
    # its token index (NoPE layers), and keys seen only within a query's chunk of attention_chunk tokens.
    qk_l2_norm: float | None = None
    attn_temperature: Temperature | None = None
    attention_chunk: int | None = None
    # Multi-head latent attention (attnx.model.terms.Latent: DeepSeek-V2/V3's MLA): q, k and v from low-rank latents,
    # the step model's cache the latent (past_latent/present_latent), not per-head keys and values.
    latent: Latent | None = None

    def __post_init__(self) -> None:
        for key in ("d_model", "n_heads"):
            check_int(key, getattr(self, key))
        for key in ("head_dim", "v_head_dim", "kv_dim", "n_kv_heads"):
            if getattr(self, key) is not None:
                check_int(key, getattr(self, key))
        for key in ("bias", "causal", "cross", "key_padding_mask", "kv_cache", "sinks", "alibi"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"config key {key!r} must be true or false, got {getattr(self, key)!r}")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(
                    f"config key 'head_dim' is required: d_model {self.d_model} is not divisible "
                    f"by n_heads {self.n_heads}"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.scale is not None:
            object.__setattr__(self, "scale", check_number("scale", self.scale))

        def set_(key: str, value: Any) -> None:
            object.__setattr__(self, key, value)

        for term in TERMS.values():  # each term's keys, in the formula's order (attnx.model.terms)
            term.validate(self, set_)

    @property
    def llm_keys(self) -> tuple[str, ...]:
        """The modern-LLM keys this config sets (LLM_KEYS), in their order; () for the plain formula."""
        return tuple(k for k in LLM_KEYS if TERMS[k].uses(self))

    @property
    def terms(self) -> tuple[str, ...]:
        """Every term of the formula this config uses, in the formula's order (attnx.model.terms.TERMS)."""
        return terms_of(self)

    # Derived sizes, named once so no caller recomputes them.
    @property
    def q_dim(self) -> int:
        """Width of the concatenated q (and k) heads: N * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of the concatenated v heads: N * v_head_dim."""
        return self.n_heads * self.v_head_dim

    @property
    def kv_q_dim(self) -> int:
        """Width of the concatenated k heads: n_kv_heads * head_dim (q_dim without grouping)."""
        return self.n_kv_heads * self.head_dim

    @property
    def kv_v_dim(self) -> int:
        """Width of the concatenated v heads: n_kv_heads * v_head_dim (v_dim without grouping)."""
        return self.n_kv_heads * self.v_head_dim

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: query head n reads key/value head n // group_size."""
        return self.n_heads // self.n_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def n_params(self) -> int:
        n = self.d_model * self.v_dim + (self.d_model if self.bias else 0)  # the output projection
        for (out_f, in_f), biased in projection_shapes(self).values():
            n += out_f * in_f + (out_f if self.bias and biased else 0)
        return n + sum(math.prod(shape) for shape, _ in term_tensors(self).values())

    def cache_specs(self, dtype: str = "fp32", length: str = "past_seq", prefix: str = "past_") -> list[CacheSpec]:
        """The step model's cache, batch first and one growing dim (`length`, axis 2): past_key [batch, n_kv_heads,
        length, head_dim] and past_value [.., v_head_dim]; with `latent` one tensor, past_latent [batch, 1, length,
        rope.dim + kv_lora_rank] (each token's rotated rope key, then its normed compressed kv). present_*
        (prefix "present_") are the same with total_seq."""
        if self.latent is not None:
            latent = self.rope.dim + self.latent.kv_lora_rank
            parts = ((ROPE_KEY, self.rope.dim), (COMPRESSED_KV, self.latent.kv_lora_rank))
            return [CacheSpec(f"{prefix}latent", dtype, ("batch", 1, length, latent), "latent", parts=parts)]
        return [CacheSpec(f"{prefix}key", dtype, ("batch", self.n_kv_heads, length, self.head_dim), "key"),
                CacheSpec(f"{prefix}value", dtype, ("batch", self.n_kv_heads, length, self.v_head_dim), "value")]  # fmt: skip

    def cache_values(self) -> int:
        """The values one token adds to the step model's cache (each cache_specs tensor's heads x size): 2 x
        n_kv_heads x head_dim for keys and values of one size, rope.dim + kv_lora_rank for a latent (the memory a
        step reads a cached token for: bench's bound, the memory estimates)."""
        return sum(spec.token_values for spec in self.cache_specs())

    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs()]

    def kv_len_dim(self) -> str:
        """Symbolic name of the key/value length: mem_seq for cross-attention, else seq."""
        return "mem_seq" if self.cross else "seq"

    def inputs(self, dtype: str = "fp32") -> list[TensorSpec]:
        """The model's inputs (docs/reference/onnx-graph.md), with the contract's dim names."""
        specs = [TensorSpec("x", dtype, ("batch", "seq", self.d_model))]
        if self.kv_cache:
            # The step model: past keys/values (or latents) in, a key padding mask over every position so far.
            specs += self.cache_specs(dtype)
            if self.key_padding_mask:
                specs.append(TensorSpec("key_padding_mask", "bool", ("batch", "total_seq")))
        else:
            if self.cross:
                specs.append(TensorSpec("memory", dtype, ("batch", "mem_seq", self.kv_dim)))
            if self.key_padding_mask:
                specs.append(TensorSpec("key_padding_mask", "bool", ("batch", self.kv_len_dim())))
        if self.rope is not None:
            # Each token's position (Hugging Face's position_ids): it only rotates q and k; the masks
            # stay over token index. Last, as the torch module's forward takes it.
            specs.append(TensorSpec("position_ids", "int64", ("batch", "seq")))
        return specs

    def outputs(self, dtype: str = "fp32") -> list[TensorSpec]:
        specs = [TensorSpec("y", dtype, ("batch", "seq", self.d_model))]
        if self.kv_cache:
            specs += self.cache_specs(dtype, "total_seq", "present_")
        return specs

    # JSON round trip. Every key is written, resolved defaults included, so a stored
    # config does not depend on the defaults of the attnx version that reads it.
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, (Rope, QKNorm, Temperature, Latent)) else value
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> AttentionConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config key {unknown[0]!r} (known keys: {', '.join(sorted(known))})")
        missing = [k for k in ("d_model", "n_heads") if k not in data]
        if missing:
            raise ConfigError(f"config key {missing[0]!r} is required")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> AttentionConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON: {e}") from None
        return cls.from_dict(data)


PRESETS: dict[str, AttentionConfig] = {
    "tiny": AttentionConfig(d_model=64, n_heads=4),
    "base": AttentionConfig(d_model=512, n_heads=8),
    "large": AttentionConfig(d_model=1024, n_heads=16),
    # The seed's numbers: GPT-3's layer, 96 heads of 128 (604M weights, 2.4 GB in fp32).
    "gpt3": AttentionConfig(d_model=12288, n_heads=96, head_dim=128),
    # Decoder layers with a KV cache: grouped-query (4 key/value heads for 16 query heads) and
    # multi-query (one key/value head), the large preset's sizes.
    "large-gqa": AttentionConfig(d_model=1024, n_heads=16, n_kv_heads=4, causal=True, kv_cache=True),
    "large-mqa": AttentionConfig(d_model=1024, n_heads=16, n_kv_heads=1, causal=True, kv_cache=True),
    # Modern LLM layers (docs/concepts/formula.md, "Modern LLM attention"). Llama 3.1 8B's attention: 32 query heads and
    # 8 key/value heads of 128, no biases, rope theta 500000 with Llama 3.1's frequency scaling
    # (meta-llama/Llama-3.1-8B config.json, rope_scaling).
    "llama3-8b": AttentionConfig(
        d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128, bias=False, causal=True,
        rope={"theta": 500000.0, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    ),
    # Gemma 2 9B's sliding layer (google/gemma-2-9b config.json): 16 query heads and 8 key/value heads
    # of 256 over a 3584-wide stream, no biases, rope theta 10000, window 4096, scores soft-capped at
    # 50, and scale query_pre_attn_scalar^-1/2 = 256^-1/2 (head_dim's, written out as the number).
    "gemma2-9b": AttentionConfig(
        d_model=3584, n_heads=16, n_kv_heads=8, head_dim=256, bias=False, causal=True, scale=256**-0.5,
        rope={"theta": 10000.0}, sliding_window=4096, softcap=50.0,
    ),
}


def preset(name: str) -> AttentionConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


# A config is a few hundred bytes; a file much larger is not one, and is not read into memory.
MAX_CONFIG_BYTES = 1024**2


def load_config(path: str | os.PathLike[str]) -> AttentionConfig:
    path = os.fspath(path)
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config {path!r} is larger than {MAX_CONFIG_BYTES} bytes: not a config")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {path!r} is not UTF-8 text: not a JSON config") from None
    return AttentionConfig.from_json(text)
