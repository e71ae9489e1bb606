"""Rotary position embeddings (RoPE): the config's `rope` key, its validation, and the one table.

The shape is Hugging Face transformers' (modeling_rope_utils.py): one table, ROPE_INIT_FUNCTIONS,
maps a rope type to a function from the rope parameters to the same pair,

    (inv_freq [dim / 2] float64, attention_factor float)

and everything downstream (the numpy reference, the torch module, the exported graph, the tolerance
table) reads only that pair, through rope_frequencies(). A new scaling is one function and one row
of the table, and its parameters' validation is one row of SCALING_PARAMS beside it.

The rotation (docs/concepts/formula.md, "Modern LLM attention"): each head's first `dim` dims form dim/2 pairs (a, b),
(i, i + dim/2) (Llama/NeoX layout) or (2i, 2i + 1) (interleaved, GPT-J); pair i at position p turns
by the angle p * inv_freq[i]:

    a' = (a cos - b sin) * attention_factor      b' = (b cos + a sin) * attention_factor

dims from `dim` to head_dim pass unchanged (partial rotary). transformers computes inv_freq and the
angle in float32; attnx's table is float64 and each consumer rounds it where it computes (the
tolerance table's rope term covers a float32 angle: attnx.model.tolerance).

longrope's short/long switch is transformers' rule, reproduced exactly (uses_long_factors): one
forward call uses the long factors for every position when its largest position + 1 exceeds
original_max_position_embeddings, the short ones otherwise, whatever a cache holds. Rope.switch_at
says whether a rope switches (longrope, or a table read with a long one), for every consumer.

A rope of type "table" is the table a graph computes with, read back from it where it fits no named
scaling (attnx.model.rope_fit): its inv_freq and attention factor as numbers, so the reader needs
no checkpoint to read a scaled rope (only to repair one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.errors import ConfigError

__all__ = [
    "Rope",
    "RopeScaling",
    "ROPE_INIT_FUNCTIONS",
    "SCALING_PARAMS",
    "SWITCHING_KEYS",
    "REFUSED_ROPE_TYPES",
    "parse_rope",
    "rope_frequencies",
    "uses_long_factors",
    "rope_angles",
    "rope_cos_sin",
    "rope_table",
    "rope_pairs",
    "rope_said",
]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A scaling of the rotary frequencies: its type (a key of ROPE_INIT_FUNCTIONS other than
    "default") and its parameters, every default resolved to a number (sorted (key, value) pairs;
    lists stored as tuples, so the config stays hashable)."""

    rope_type: str
    params: tuple[tuple[str, Any], ...]

    def __getitem__(self, key: str) -> Any:
        return dict(self.params)[key]

    def to_dict(self) -> dict[str, Any]:
        return {"rope_type": self.rope_type, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.params}}


@dataclasses.dataclass(frozen=True)
class Rope:
    """The config's `rope`: theta (the base), dim (rotary dims per head, even, <= head_dim),
    interleaved (pairs (2i, 2i + 1) rather than (i, i + dim/2)), scaling (None: the plain
    frequencies theta^(-2i/dim))."""

    theta: float
    dim: int
    interleaved: bool = False
    scaling: RopeScaling | None = None

    @property
    def rope_type(self) -> str:
        return self.scaling.rope_type if self.scaling is not None else "default"

    @property
    def switch_at(self) -> int | None:
        """The length past which one call takes the long table (longrope's rule: uses_long_factors), or None where
        every call takes the one table."""
        s = self.scaling
        if s is None or not any(key in SWITCHING_KEYS for key, _ in s.params):
            return None
        return s["original_max_position_embeddings"]

    def to_dict(self) -> dict[str, Any]:
        return {"theta": self.theta, "dim": self.dim, "interleaved": self.interleaved,
                "scaling": self.scaling.to_dict() if self.scaling is not None else None}  # fmt: skip


# The table --------------------------------------------------------------------------------------
def _base_inv_freq(theta: float, dim: int) -> np.ndarray:
    """theta^(-2i/dim), i = 0 .. dim/2 - 1: the frequencies of the original RoPE."""
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def _default(rope: Rope, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """RoPE as introduced: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position
    Embedding" (arXiv 2104.09864). Parameters: theta (the base), dim. attention_factor 1."""
    return _base_inv_freq(rope.theta, rope.dim), 1.0


def _linear(rope: Rope, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Position interpolation: Chen et al. 2023, "Extending Context Window of Large Language
    Models via Positional Interpolation" (arXiv 2306.15595; kaiokendev's SuperHOT). Positions are
    divided by `factor`, which is the frequencies divided by it. attention_factor 1."""
    return _base_inv_freq(rope.theta, rope.dim) / rope.scaling["factor"], 1.0


def _llama3(rope: Rope, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """Llama 3.1's frequency-dependent interpolation: Grattafiori et al. 2024, "The Llama 3 Herd of
    Models" (arXiv 2407.21783; meta-llama's reference code). Parameters: factor (8), low_freq_factor
    (1), high_freq_factor (4), original_max_position_embeddings (8192). A frequency whose wavelength
    2 pi / f is shorter than original / high_freq_factor is kept; longer than original /
    low_freq_factor, divided by factor; between, interpolated with the smooth factor
    (original / wavelength - low) / (high - low). attention_factor 1."""
    s = rope.scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    original = s["original_max_position_embeddings"]
    inv_freq = _base_inv_freq(rope.theta, rope.dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > original / low, inv_freq / factor, inv_freq)  # long waves: interpolated
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return np.where(medium, smoothed, out), 1.0


def _yarn(rope: Rope, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """YaRN: Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models"
    (arXiv 2309.00071). Parameters: factor, original_max_position_embeddings, beta_fast (32) and
    beta_slow (1), the rotation counts bounding the ramp between extrapolated (kept) and
    interpolated (divided by factor) dims, truncate (true: the ramp's ends rounded to whole dims),
    attention_factor (resolved when the config is read: 0.1 ln(factor) + 1, or the mscale ratio)."""
    s = rope.scaling
    dim, theta, factor = rope.dim, rope.theta, s["factor"]
    original = s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength fits `rotations` times in the original length
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolated = 1.0 - ramp  # 1: the dim keeps its frequency; 0: divided by factor
    inv_freq = _base_inv_freq(theta, dim)
    return inv_freq / factor * (1 - extrapolated) + inv_freq * extrapolated, s["attention_factor"]


def _longrope(rope: Rope, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """LongRoPE: Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens"
    (arXiv 2402.13753; Phi-3). Parameters: short_factor and long_factor (dim/2 rescale factors
    each: inv_freq_i = theta^(-2i/dim) / factor_i), original_max_position_embeddings,
    attention_factor (resolved when read: sqrt(1 + ln(factor) / ln(original)) for factor > 1).
    seq_len (the call's largest position + 1) above the original length takes the long factors."""
    s = rope.scaling
    long = seq_len is not None and seq_len > s["original_max_position_embeddings"]
    factors = np.asarray(s["long_factor"] if long else s["short_factor"], dtype=np.float64)
    return _base_inv_freq(rope.theta, rope.dim) / factors, s["attention_factor"]


def _table(rope: Rope, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """The table a graph computes with, as read from it (attnx.model.rope_fit.rope_of_table) where it fits no
    named scaling: its frequencies themselves. Parameters: inv_freq (dim/2 numbers), attention_factor (1); and
    where the graph switches tables by length as longrope does, long_inv_freq with original_max_position_embeddings
    (seq_len above it takes the long one)."""
    s = dict(rope.scaling.params)
    long = s.get("long_inv_freq") is not None and seq_len is not None and seq_len > s["original_max_position_embeddings"]
    return np.asarray(s["long_inv_freq" if long else "inv_freq"], dtype=np.float64), s["attention_factor"]


ROPE_INIT_FUNCTIONS: dict[str, Callable[[Rope, int | None], tuple[np.ndarray, float]]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "longrope": _longrope,
    "table": _table,
}
# the parameters of a scaling that switches to a long table past original_max_position_embeddings (Rope.switch_at)
SWITCHING_KEYS = ("long_factor", "long_inv_freq")
# Rope types attnx refuses, and why: their frequencies are not a function of the config alone.
REFUSED_ROPE_TYPES = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from each run's sequence length, so one "
    "exported graph would need a different table per length",
}


# Validation, beside the table -------------------------------------------------------------------
def _yarn_attention_factor(p: dict[str, Any]) -> float:
    """transformers' default: 0.1 ln(factor) + 1 (1 for factor <= 1), or with mscale and
    mscale_all_dim the ratio of the two such terms (DeepSeek's form)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("mscale") and p.get("mscale_all_dim"):
        return mscale(p["factor"], p["mscale"]) / mscale(p["factor"], p["mscale_all_dim"])
    return mscale(p["factor"])


def _longrope_attention_factor(p: dict[str, Any]) -> float:
    """transformers' default: sqrt(1 + ln(factor) / ln(original)) for factor > 1, else 1. factor
    is the checkpoint's max_position_embeddings / original_max_position_embeddings (the importer
    resolves it when the checkpoint gives neither)."""
    if p.get("factor") is None:
        raise ConfigError(
            "config key 'rope.scaling.attention_factor' is required for longrope when 'factor' is not given "
            "(transformers derives it from max_position_embeddings / original_max_position_embeddings)"
        )
    factor = p["factor"]
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(p["original_max_position_embeddings"]))


@dataclasses.dataclass(frozen=True)
class ScalingParams:
    """One scaling type's parameters: required ones, stored defaults, inputs read only to resolve a
    default (not stored), and how attention_factor is resolved when the config gives none."""

    required: tuple[str, ...]
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    resolve_only: tuple[str, ...] = ()
    attention_factor: Callable[[dict[str, Any]], float] | None = None
    optional: tuple[str, ...] = ()  # stored where given, absent otherwise


SCALING_PARAMS: dict[str, ScalingParams] = {
    "linear": ScalingParams(("factor",)),
    "llama3": ScalingParams(("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    "yarn": ScalingParams(("factor", "original_max_position_embeddings"),
                          {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}, ("mscale", "mscale_all_dim"),
                          _yarn_attention_factor),
    "longrope": ScalingParams(("short_factor", "long_factor", "original_max_position_embeddings"), {}, ("factor",),
                              _longrope_attention_factor),
    "table": ScalingParams(("inv_freq",), {}, (), lambda p: 1.0, ("long_inv_freq", "original_max_position_embeddings")),
}  # fmt: skip
_INT_PARAMS = ("original_max_position_embeddings",)
_BOOL_PARAMS = ("truncate",)
_LIST_PARAMS = ("short_factor", "long_factor", "inv_freq", "long_inv_freq")


def _number(key: str, value: Any, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"config key {key!r} must be positive, got {value!r}")
    return float(value)


def _parse_scaling(value: Any, dim: int) -> RopeScaling | None:
    if value is None:
        return None
    if not isinstance(value, (dict, RopeScaling)):
        raise ConfigError(f"config key 'rope.scaling' must be an object or null, got {value!r}")
    data = value.to_dict() if isinstance(value, RopeScaling) else dict(value)
    kind = data.pop("rope_type", data.pop("type", None))  # transformers' older checkpoints say "type"
    if kind in REFUSED_ROPE_TYPES:
        raise ConfigError(f"config key 'rope.scaling.rope_type' {kind!r} is refused: {REFUSED_ROPE_TYPES[kind]}")
    if kind == "default":
        if data:
            raise ConfigError(f"config key 'rope.scaling.{sorted(data)[0]}' is unknown for rope_type 'default'")
        return None
    if kind not in SCALING_PARAMS:
        raise ConfigError(
            f"config key 'rope.scaling.rope_type' must be one of {', '.join(['default', *SCALING_PARAMS])}, "
            f"got {kind!r}"
        )
    spec = SCALING_PARAMS[kind]
    known = {
        *spec.required,
        *spec.defaults,
        *spec.resolve_only,
        *spec.optional,
        *(("attention_factor",) if spec.attention_factor else ()),
    }
    for key in sorted(data):
        if key not in known:
            raise ConfigError(
                f"config key 'rope.scaling.{key}' is unknown for rope_type {kind!r} (known: {', '.join(sorted(known))})"
            )
    params: dict[str, Any] = {}
    for key in spec.required:
        if data.get(key) is None:
            raise ConfigError(f"config key 'rope.scaling.{key}' is required for rope_type {kind!r}")
    for key in (*spec.required, *spec.defaults, *spec.resolve_only, *spec.optional, "attention_factor"):
        raw = data.get(key)
        if raw is None:
            if key in spec.defaults:
                params[key] = spec.defaults[key]
            continue
        name = f"rope.scaling.{key}"
        if key in _BOOL_PARAMS:
            if not isinstance(raw, bool):
                raise ConfigError(f"config key {name!r} must be true or false, got {raw!r}")
            params[key] = raw
        elif key in _INT_PARAMS:
            if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
                raise ConfigError(f"config key {name!r} must be a positive integer, got {raw!r}")
            params[key] = raw
        elif key in _LIST_PARAMS:
            if not isinstance(raw, (list, tuple)) or len(raw) != dim // 2:
                raise ConfigError(f"config key {name!r} must be a list of rope.dim / 2 = {dim // 2} numbers")
            params[key] = tuple(_number(name, v) for v in raw)
        else:
            params[key] = _number(name, raw)
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ConfigError(
            "config key 'rope.scaling.high_freq_factor' must be larger than low_freq_factor "
            f"({params['high_freq_factor']} <= {params['low_freq_factor']})"
        )
    if kind == "table" and ("long_inv_freq" in params) != ("original_max_position_embeddings" in params):
        raise ConfigError("config keys 'rope.scaling.long_inv_freq' and 'original_max_position_embeddings' go "
                          "together for rope_type 'table' (the long table, and the length past which it is used)")
    if spec.attention_factor is not None and "attention_factor" not in params:
        params["attention_factor"] = float(spec.attention_factor(params))
    for key in spec.resolve_only:
        params.pop(key, None)  # read to resolve attention_factor; the resolved number is what is stored
    return RopeScaling(kind, tuple(sorted(params.items())))


def parse_rope(value: Any, head_dim: int) -> Rope | None:
    """The config's `rope` (a JSON object, a Rope, or None) checked and with every default
    resolved, or one ConfigError naming the key."""
    if value is None:
        return None
    if isinstance(value, Rope):
        value = value.to_dict()
    if not isinstance(value, dict):
        raise ConfigError(f"config key 'rope' must be an object or null, got {value!r}")
    known = ("theta", "dim", "interleaved", "scaling")
    for key in sorted(value):
        if key not in known:
            raise ConfigError(f"config key 'rope.{key}' is unknown (known: {', '.join(known)})")
    if value.get("theta") is None:
        raise ConfigError("config key 'rope.theta' is required (the base of the frequencies, 10000 in RoFormer)")
    theta = _number("rope.theta", value["theta"])
    if theta <= 1:
        raise ConfigError(f"config key 'rope.theta' must be larger than 1, got {value['theta']!r}")
    dim = value.get("dim")
    if dim is None:
        dim = head_dim
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2 or dim > head_dim:
        raise ConfigError(
            f"config key 'rope.dim' must be an even positive integer <= head_dim ({head_dim}), got {dim!r}"
        )
    interleaved = value.get("interleaved", False)
    if not isinstance(interleaved, bool):
        raise ConfigError(f"config key 'rope.interleaved' must be true or false, got {interleaved!r}")
    return Rope(theta, dim, interleaved, _parse_scaling(value.get("scaling"), dim))


# What the consumers read ------------------------------------------------------------------------
def rope_frequencies(rope: Rope, seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float64, attention_factor) of the table's row for this rope. seq_len:
    the call's largest position + 1 (only longrope reads it: uses_long_factors)."""
    return ROPE_INIT_FUNCTIONS[rope.rope_type](rope, seq_len)


def uses_long_factors(rope: Rope, positions: np.ndarray) -> bool:
    """longrope's switch, transformers' rule: a call whose largest position + 1 exceeds
    original_max_position_embeddings uses the long factors for all its positions (every batch
    element, every token: a cache rotated with the short ones is not rotated again)."""
    if rope.switch_at is None or np.size(positions) == 0:
        return False
    return int(np.max(positions)) + 1 > rope.switch_at


def rope_angles(rope: Rope, positions: np.ndarray) -> tuple[np.ndarray, float]:
    """(angles [..., dim/2] float64 = position * inv_freq, attention_factor) for integer
    `positions` of one call (any shape)."""
    positions = np.asarray(positions)
    seq_len = int(np.max(positions)) + 1 if positions.size else None
    inv_freq, factor = rope_frequencies(rope, seq_len)
    return positions.astype(np.float64)[..., None] * inv_freq, factor


def rope_table(inv_freq: np.ndarray, factor: float, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """The cos/sin table a graph rotates with (GroupQueryAttention's cos_cache and sin_cache, do_rotary):
    [positions, dim/2] float32, row p the cos and sin of p * inv_freq times attention_factor, the angle in float32
    as every form computes it (the graph's Mul of float32 positions and frequencies), its cos and sin in float64."""
    angle = np.arange(positions, dtype=np.float32)[:, None] * np.asarray(inv_freq, np.float32).reshape(-1)[None, :]
    return ((np.cos(angle.astype(np.float64)) * factor).astype(np.float32),
            (np.sin(angle.astype(np.float64)) * factor).astype(np.float32))  # fmt: skip


def rope_cos_sin(rope: Rope, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the angles, each times attention_factor: [..., dim/2] float64."""
    angles, factor = rope_angles(rope, positions)
    return np.cos(angles) * factor, np.sin(angles) * factor


def rope_pairs(rope: Rope) -> tuple[np.ndarray, np.ndarray]:
    """(a, b): the head dims of pair i are a[i] and b[i]: (i, i + dim/2), or (2i, 2i + 1) when
    interleaved."""
    half = rope.dim // 2
    if rope.interleaved:
        return np.arange(0, rope.dim, 2), np.arange(1, rope.dim, 2)
    return np.arange(half), np.arange(half, rope.dim)


# The parameters a reader names a scaling by (rope_said), in the order said.
_SAID = {"linear": ("factor",),
         "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
         "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor"),
         "longrope": ("original_max_position_embeddings", "attention_factor")}  # fmt: skip


def rope_said(rope: Rope) -> str:
    """A rope in words, as a report names it: "theta 10000", "llama3, theta 500000, factor 8, low_freq_factor 1,
    high_freq_factor 4, original 8192", or "the graph's own table (16 frequencies)"."""
    if rope.rope_type == "table":
        switch = f", its long one past {rope.switch_at}" if rope.switch_at is not None else ""
        return f"the graph's own table ({rope.dim // 2} frequencies{switch})"
    said = [f"theta {rope.theta:g}"]
    if rope.scaling is not None:
        values = dict(rope.scaling.params)
        said = [rope.rope_type, *said] + [
            f"{key.replace('_max_position_embeddings', '')} "
            + (str(values[key]).lower() if isinstance(values[key], bool) else f"{values[key]:g}")
            for key in _SAID.get(rope.rope_type, ()) if key in values]  # fmt: skip
    return ", ".join(said)
