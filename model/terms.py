"""The terms of the formula, as data: one entry a term, in the formula's order.

A term is a part of the formula that a config switches on (docs/concepts/formula.md and "Modern LLM
attention"). Each entry says:

    keys        the config keys that set it, and validate(): their checks and normal form
    place       where it acts, in the formula's order (PLACES)
    uses()      whether a config uses it
    tensors()   the weights it adds beside the projections, and how seeded weights draw them
    reach()     a mask's reach: a query sees no key more than reach - 1 tokens before it (a window's W): what
                a step reads of its cache, how far a probe of a computed mask must run
    tolerance   what it adds to the tolerance table (attnx.model.tolerance), in words; score_bound(): what it
                adds to the largest absolute score, by which the table scales the scores' bound
    table()     the constants its formula is built from, where a check compares them with a source's
    fault       the wrong form of the term the tests plant, to show a check finds it
    said()      how a formula's one line says it (or leaves it out); listed: whether an audit's block line
                lists it; sdpa_is_causal: whether SDPA's is_causal computes it alone (the torch half)

Its functions live with the formula they belong to, one mapping per array library, keyed by the
term's name: the numpy reference's (attnx.model.reference.REFERENCE_TERMS) and the torch module's
(attnx.model.module.TORCH_TERMS); the ONNX emitters of each core say how the core writes it
(attnx.export's emitters) and the core registry which cores express it (attnx.model.cores). Adding a
term is one entry here, its functions there, and the cores' rows that take it: the checks, the CLI
and the reports read these tables.

No torch and no onnx here: the deployment side reads it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from attnx.errors import ConfigError
from attnx.model.alibi import alibi_slopes
from attnx.model.rope import parse_rope, rope_said

if TYPE_CHECKING:
    from attnx.model.config import AttentionConfig

__all__ = ["PLACES", "Latent", "QKNorm", "Temperature", "Term", "TERMS", "LLM_TERMS", "terms_of", "term_tensors", "check_int", "check_number",
           "reach_of", "terms_at", "projection_shapes"]

# Where a term acts, in the formula's order:
#   heads     how the projections are laid out (grouped key/value heads, a second sequence)
#   qk        q and k before they are scored and cached: per head, [batch, seq, heads, head_dim]
#   cache     the keys and values of earlier steps joined before the scores
#   scores    s = scale * q.k, then each score term in order: s [.., queries, keys]
#   mask      which keys a query sees (over token index): the union of what each hides
#   softmax   more logits in the softmax's denominator, with no value
PLACES = ("heads", "qk", "cache", "scores", "mask", "softmax")


def check_int(key: str, value: Any) -> int:
    """`value` when it is a positive int (not a bool), else one ConfigError naming `key`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"config key {key!r} must be positive, got {value}")
    return value


def check_number(key: str, value: Any) -> float:
    """`value` as a float when it is a finite positive number (not a bool), else one ConfigError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config key {key!r} must be a number or null, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"config key {key!r} must be a finite positive number, got {value!r}")
    return float(value)


def _validate_alibi(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.alibi and c.cross:
        # A distance between a query and a key of another sequence: no model attnx imports has it.
        raise ConfigError("config key 'alibi' is for self-attention ('cross': false)")


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")


@dataclasses.dataclass(frozen=True)
class QKNorm:
    """The config's `qk_norm`: RMSNorm of each head's q and k over head_dim, x / sqrt(mean(x^2) + eps)
    times the weights q_norm.weight / k_norm.weight [head_dim], before rope (Qwen3, Gemma 3)."""

    eps: float

    def to_dict(self) -> dict[str, Any]:
        return {"eps": self.eps}


@dataclasses.dataclass(frozen=True)
class Temperature:
    """The config's `attn_temperature`: the query at token index i (its slot, padding included) scaled by
    log1p(floor((i + 1) / floor_scale)) * attn_scale + 1 before it is scored (Llama 4's attention temperature
    tuning on its NoPE layers, arXiv:2501.19399)."""

    floor_scale: float
    attn_scale: float

    def to_dict(self) -> dict[str, Any]:
        return {"floor_scale": self.floor_scale, "attn_scale": self.attn_scale}

    def factors(self, tokens: np.ndarray) -> np.ndarray:
        """The factor of each query token index, float64 (the one definition every form follows)."""
        return np.log1p(np.floor((np.asarray(tokens, np.float64) + 1.0) / self.floor_scale)) * self.attn_scale + 1.0


@dataclasses.dataclass(frozen=True)
class Latent:
    """The config's `latent`: multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, MiniCPM3; transformers'
    DeepseekV3Attention). q from x (q_proj) or through a low-rank latent (q_a_proj to q_lora_rank, RMSNorm
    q_a_layernorm, q_b_proj); k and v from one latent per token, kv_a_proj_with_mqa's [compressed kv (kv_lora_rank,
    RMSNorm kv_a_layernorm) | one shared rope key (rope.dim)], the compressed kv expanded by kv_b_proj to each head's
    [k_nope (head_dim - rope.dim) | v (v_head_dim)]. A head's q and k are laid out [rope part | nope part] (the rope
    term turns a head's first rope.dim dims; a permutation of the dims leaves q.k unchanged); the cache holds the
    latent, [rotated rope key | normed compressed kv], one "head" of rope.dim + kv_lora_rank per token."""

    kv_lora_rank: int
    q_lora_rank: int | None
    eps: float  # the RMSNorms' (transformers' DeepseekV3RMSNorm default, 1e-6: not rms_norm_eps)

    def to_dict(self) -> dict[str, Any]:
        return {"kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank, "eps": self.eps}


Config = Any  # an AttentionConfig (config.py imports this module: the type is named in TYPE_CHECKING only)
Weights = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of the formula (the module doc)."""

    name: str
    keys: tuple[str, ...]
    place: str
    summary: str  # what it computes, one line (the docs' tables: docs/reference/capabilities.md)
    uses: Callable[[Config], bool]
    validate: Callable[[Config, Callable[[str, Any], None]], None] = lambda c, set_: None
    # {name: (shape, (low, high) of its seeded draw)} of the tensors it adds to the weights file
    tensors: Callable[[Config], Mapping[str, tuple[tuple[int, ...], tuple[float, float]]]] = lambda c: {}
    reach: Callable[[Config], int] | None = None
    tolerance: str = "none"
    # what the term adds to the largest absolute score of `keys` keys scored (the tolerance's S), or None
    score_bound: Callable[[Config, int], float] | None = None
    table: Callable[[Config], np.ndarray] | None = None  # the constants its formula is built from
    fault: Callable[[Config, Weights], tuple[Config, Weights]] | None = None
    fault_summary: str = ""
    modern: bool = False  # one of the modern-LLM terms (docs/concepts/formula.md, "Modern LLM attention")
    # computed from a token's slot in its batch (padding included), not its position: a left-padded row computes it
    # otherwise than alone, so rows of other lengths cannot share a batch without changing each other's tokens
    by_slot: bool = False
    # the projections it computes q, k and v with instead of q_proj, k_proj and v_proj: {name: ((out, in), biased)}
    # (a biased one has a bias when the config's `bias` is true); None: the plain three
    projections: Callable[[Config], Mapping[str, tuple[tuple[int, int], bool]]] | None = None
    # how a formula's one line says it (said(): attnx.workflows.rewrite.report.formula_said): its values (None: its
    # keys'), or not at all where unsaid (the heads are said with their counts; the cache and the padding are how a
    # model runs, causal how every decoder attends)
    says: Callable[[Config], list[Any]] | None = None
    unsaid: bool = False
    listed: bool = True  # a block's audit line lists it (causal, every decoder block's, is not)
    sdpa_is_causal: bool = False  # SDPA's is_causal computes it alone (the only mask term, no cache: the torch half)

    def said(self, c: Config) -> str | None:
        """The term in a formula's one line, with its values (a value of True or None unsaid); None: left out."""
        if self.unsaid:
            return None
        values = self.says(c) if self.says is not None else [getattr(c, key) for key in self.keys]
        out = ", ".join(str(v) for v in values if v is not None and v is not True)
        return f"{self.name} {out}" if out else self.name


def _replace(c: Config, **changes: Any) -> Config:
    return dataclasses.replace(c, **changes)


# Validation of each term's keys. `set_(key, value)` writes a key's normal form into the frozen config.
def _validate_grouped(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.n_kv_heads is None:
        set_("n_kv_heads", c.n_heads)
    check_int("n_kv_heads", c.n_kv_heads)
    if c.n_heads % c.n_kv_heads:
        raise ConfigError(
            f"config key 'n_kv_heads' ({c.n_kv_heads}) must divide n_heads ({c.n_heads}): "
            "each key/value head serves an equal group of query heads"
        )


def _validate_cross(c: Config, set_: Callable[[str, Any], None]) -> None:
    _check_bool("cross", c.cross)
    if c.kv_dim is None:
        set_("kv_dim", c.d_model)
    check_int("kv_dim", c.kv_dim)
    if c.causal and c.cross:
        raise ConfigError("config keys 'causal' and 'cross' cannot both be true: the causal mask is for self-attention")
    if not c.cross and c.kv_dim != c.d_model:
        raise ConfigError(f"config key 'kv_dim' ({c.kv_dim}) must equal d_model ({c.d_model}) without 'cross'")


def _validate_cache(c: Config, set_: Callable[[str, Any], None]) -> None:
    _check_bool("kv_cache", c.kv_cache)
    if c.kv_cache and not (c.causal and not c.cross):
        raise ConfigError(
            "config key 'kv_cache' needs causal self-attention ('causal': true, 'cross': false): "
            "a cache holds the keys of earlier tokens of the same sequence"
        )


def _validate_rope(c: Config, set_: Callable[[str, Any], None]) -> None:
    set_("rope", parse_rope(c.rope, c.head_dim))
    if c.cross and c.rope is not None:
        # Positions of a second sequence: no model attnx imports has them.
        raise ConfigError("config key 'rope' is for self-attention ('cross': false)")


def _number_object(key: str, value: Any, cls: type) -> Any:
    """`cls` (a frozen dataclass of numbers: QKNorm, Temperature) from a config object with exactly its fields, each
    a finite positive number; one ConfigError naming the key (or key.field) otherwise."""
    names = [f.name for f in dataclasses.fields(cls)]
    data = value.to_dict() if isinstance(value, cls) else value
    if not isinstance(data, dict) or set(data) != set(names):
        shape = ", ".join(f'"{n}": number' for n in names)
        raise ConfigError(f"config key {key!r} must be null or an object {{{shape}}}, got {value!r}")
    for n in names:
        v = data[n]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
            raise ConfigError(f"config key '{key}.{n}' must be a finite positive number, got {v!r}")
    return cls(**{n: float(data[n]) for n in names})


def _validate_qk_norm(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.qk_norm is None:
        return
    set_("qk_norm", _number_object("qk_norm", c.qk_norm, QKNorm))
    if c.cross:
        raise ConfigError("config key 'qk_norm' is for self-attention ('cross': false)")


def _validate_l2_norm(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.qk_l2_norm is None:
        return
    set_("qk_l2_norm", check_number("qk_l2_norm", c.qk_l2_norm))
    if c.cross:
        raise ConfigError("config key 'qk_l2_norm' is for self-attention ('cross': false)")


def _validate_temperature(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.attn_temperature is None:
        return
    set_("attn_temperature", _number_object("attn_temperature", c.attn_temperature, Temperature))
    if c.cross:
        raise ConfigError("config key 'attn_temperature' is for self-attention ('cross': false)")


def _validate_chunk(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.attention_chunk is None:
        return
    check_int("attention_chunk", c.attention_chunk)
    if not c.causal:
        raise ConfigError("config key 'attention_chunk' needs 'causal': true (a query sees the keys of its own chunk "
                          "up to itself)")  # fmt: skip


def _validate_window(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.sliding_window is None:
        return
    check_int("sliding_window", c.sliding_window)
    if not c.causal:
        raise ConfigError("config key 'sliding_window' needs 'causal': true (query p sees key j only if p - W < j <= p)")


def _validate_latent(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.latent is None:
        return
    value = c.latent.to_dict() if isinstance(c.latent, Latent) else c.latent
    if not isinstance(value, dict) or set(value) != {"kv_lora_rank", "q_lora_rank", "eps"}:
        raise ConfigError('config key \'latent\' must be null or an object {"kv_lora_rank": int, "q_lora_rank": '
                          f'int or null, "eps": number}}, got {c.latent!r}')  # fmt: skip
    check_int("latent.kv_lora_rank", value["kv_lora_rank"])
    if value["q_lora_rank"] is not None:
        check_int("latent.q_lora_rank", value["q_lora_rank"])
    latent = Latent(value["kv_lora_rank"], value["q_lora_rank"], check_number("latent.eps", value["eps"]))
    set_("latent", latent)
    if c.rope is None:
        raise ConfigError("config key 'latent' needs 'rope': its shared key part is the rope's dims (rope.dim)")
    rope = parse_rope(c.rope, c.head_dim)  # (the rope term's normal form, set when its own keys are validated)
    if rope.dim >= c.head_dim:
        raise ConfigError(f"config key 'latent' needs rope.dim ({rope.dim}) below head_dim ({c.head_dim}): a head "
                          "is [rope part | nope part], the nope part from the compressed kv")  # fmt: skip
    if c.n_kv_heads != c.n_heads:
        raise ConfigError(f"config key 'latent' expands the latent to every head's k and v: n_kv_heads "
                          f"({c.n_kv_heads}) must equal n_heads ({c.n_heads})")  # fmt: skip
    for key in ("cross", "qk_norm", "qk_l2_norm"):
        if getattr(c, key) not in (None, False):
            raise ConfigError(f"config keys 'latent' and {key!r} do not go together (no model attnx imports has both)")


def _latent_projections(c: Config) -> dict[str, tuple[tuple[int, int], bool]]:
    """transformers' DeepseekV3Attention's projections (attention_bias on q_a_proj, kv_a_proj_with_mqa and o_proj)."""
    L, nope = c.latent, c.head_dim - c.rope.dim
    q = ({"q_proj": ((c.q_dim, c.d_model), True)} if L.q_lora_rank is None else
         {"q_a_proj": ((L.q_lora_rank, c.d_model), True), "q_b_proj": ((c.q_dim, L.q_lora_rank), False)})
    return {**q, "kv_a_proj_with_mqa": ((L.kv_lora_rank + c.rope.dim, c.d_model), True),
            "kv_b_proj": ((c.n_heads * (nope + c.v_head_dim), L.kv_lora_rank), False)}  # fmt: skip


def _latent_norms(c: Config) -> dict[str, tuple[tuple[int, ...], tuple[float, float]]]:
    L = c.latent
    q = {} if L.q_lora_rank is None else {"q_a_layernorm.weight": ((L.q_lora_rank,), (0.5, 1.5))}
    return {**q, "kv_a_layernorm.weight": ((L.kv_lora_rank,), (0.5, 1.5))}


def _roll_latent_heads(c: Config, w: Weights) -> tuple[Config, Weights]:
    """Head n's k_nope and v expanded with head n+1's rows of kv_b_proj."""
    out = dict(w)
    rows = np.asarray(w["kv_b_proj.weight"]).reshape(c.n_heads, -1, c.latent.kv_lora_rank)
    out["kv_b_proj.weight"] = np.roll(rows, 1, axis=0).reshape(w["kv_b_proj.weight"].shape)
    return c, out


def _validate_softcap(c: Config, set_: Callable[[str, Any], None]) -> None:
    if c.softcap is not None:
        set_("softcap", check_number("softcap", c.softcap))


# Planted faults: the term computed wrong, as a config or weights a check must tell from the right ones.
def _permute_kv_heads(c: Config, w: Weights) -> tuple[Config, Weights]:
    """Key head g computed from head g+1's weights (query heads read the wrong group's keys)."""
    out = dict(w)
    rows = np.asarray(w["k_proj.weight"]).reshape(c.n_kv_heads, c.head_dim, -1)
    out["k_proj.weight"] = np.roll(rows, 1, axis=0).reshape(w["k_proj.weight"].shape)
    if c.bias:
        out["k_proj.bias"] = np.roll(np.asarray(w["k_proj.bias"]).reshape(c.n_kv_heads, -1), 1, axis=0).ravel()
    return c, out


def _flip_rope_layout(c: Config, w: Weights) -> tuple[Config, Weights]:
    rope = dataclasses.replace(c.rope, interleaved=not c.rope.interleaved)
    return _replace(c, rope=rope), w


def _window_off_by_one(c: Config, w: Weights) -> tuple[Config, Weights]:
    return _replace(c, sliding_window=c.sliding_window + 1), w


def _double_softcap(c: Config, w: Weights) -> tuple[Config, Weights]:
    return _replace(c, softcap=2 * c.softcap), w


def _swap_qk_norms(c: Config, w: Weights) -> tuple[Config, Weights]:
    out = dict(w)
    out["q_norm.weight"], out["k_norm.weight"] = w["k_norm.weight"], w["q_norm.weight"]
    return c, out


def _drop_l2_norm(c: Config, w: Weights) -> tuple[Config, Weights]:
    # (the norm before the rotation would be no fault: a rotation of every pair keeps each head's mean square)
    return _replace(c, qk_l2_norm=None), w


def _double_temperature(c: Config, w: Weights) -> tuple[Config, Weights]:
    t = c.attn_temperature
    return _replace(c, attn_temperature=Temperature(t.floor_scale, 2 * t.attn_scale)), w


def _chunk_off_by_one(c: Config, w: Weights) -> tuple[Config, Weights]:
    return _replace(c, attention_chunk=c.attention_chunk + 1), w


def _drop_alibi(c: Config, w: Weights) -> tuple[Config, Weights]:
    return _replace(c, alibi=False), w


def _drop_sinks(c: Config, w: Weights) -> tuple[Config, Weights]:
    return _replace(c, sinks=False), {k: v for k, v in w.items() if k != "sinks"}


def _no_causal_mask(c: Config, w: Weights) -> tuple[Config, Weights]:
    return _replace(c, causal=False, sliding_window=None), w


def _rope_says(c: Config) -> list[Any]:
    r = c.rope
    return [rope_said(r) + (f", dim {r.dim}" if r.dim != c.head_dim else "") + (", interleaved" if r.interleaved else "")]


TERMS: dict[str, Term] = {
    t.name: t
    for t in (
        Term("grouped_heads", ("n_kv_heads",), "heads",
             "n_kv_heads key/value heads, each read by a group of n_heads / n_kv_heads query heads",
             lambda c: c.n_kv_heads != c.n_heads, _validate_grouped,
             fault=_permute_kv_heads, fault_summary="key/value heads permuted (k_proj rows rolled by one head)",
             unsaid=True),
        Term("cross", ("cross", "kv_dim"), "heads", "keys and values projected from a second sequence, memory",
             lambda c: c.cross, _validate_cross),
        Term("latent", ("latent",), "heads",
             "multi-head latent attention (MLA): q through a low-rank latent, k and v expanded from one cached latent "
             "per token (kv_lora_rank + rope.dim), its rope part one key shared by every head",
             lambda c: c.latent is not None, _validate_latent, tensors=_latent_norms,
             tolerance="none: K is the longest of d_model, the ranks and head_dim (each a reduction it covers)",
             fault=_roll_latent_heads, fault_summary="kv_b_proj's heads rolled by one", modern=True,
             projections=_latent_projections,
             says=lambda c: [f"kv_lora_rank {c.latent.kv_lora_rank}", f"q_lora_rank {c.latent.q_lora_rank}"
                             if c.latent.q_lora_rank is not None else "q_proj"]),  # fmt: skip
        Term("qk_norm", ("qk_norm",), "qk", "RMSNorm of each head's q and k over head_dim, times q_norm/k_norm.weight",
             lambda c: c.qk_norm is not None, _validate_qk_norm,
             tensors=lambda c: {"q_norm.weight": ((c.head_dim,), (0.5, 1.5)),
                                "k_norm.weight": ((c.head_dim,), (0.5, 1.5))},
             tolerance="none: a norm drops the error's radial part",
             fault=_swap_qk_norms, fault_summary="q_norm and k_norm weights swapped", modern=True),
        Term("rope", ("rope",), "qk",
             "q and k rotated by position (position_ids), pairs by inv_freq from the rope table (attnx.model.rope)",
             lambda c: c.rope is not None, _validate_rope,
             tolerance="4 eps32 P B rms(ref): the float32 angle's rounding at position P (tolerance, 'Rotary positions')",
             fault=_flip_rope_layout, fault_summary="the pair layout flipped (interleaved <-> half-split)",
             modern=True, says=_rope_says),
        Term("qk_l2_norm", ("qk_l2_norm",), "qk",
             "each head's q and k divided by sqrt(mean(x^2) + eps) after rope, no weights (Llama 4's L2Norm)",
             lambda c: c.qk_l2_norm is not None, _validate_l2_norm,
             tolerance="none: a norm drops the error's radial part",
             fault=_drop_l2_norm, fault_summary="the norm dropped", modern=True),
        Term("attn_temperature", ("attn_temperature",), "qk",
             "q at token index i times log1p(floor((i + 1) / floor_scale)) * attn_scale + 1 (Llama 4's NoPE layers)",
             lambda c: c.attn_temperature is not None, _validate_temperature,
             tolerance="S (the largest absolute score) is taken from q as scaled",
             fault=_double_temperature, fault_summary="attn_scale doubled", modern=True, by_slot=True),
        Term("kv_cache", ("kv_cache",), "cache", "the step model: past keys/values joined before the scores",
             lambda c: c.kv_cache, _validate_cache, unsaid=True),
        Term("softcap", ("softcap",), "scores", "s -> c tanh(s / c), after the scale, before the masks",
             lambda c: c.softcap is not None, _validate_softcap,
             tolerance="none: the slope of c tanh(s / c) is at most 1",
             fault=_double_softcap, fault_summary="the cap doubled", modern=True),
        Term("alibi", ("alibi",), "scores",
             "head h adds slope_h * (j - i) over token index (attnx.model.alibi's slopes: BLOOM, MPT)",
             lambda c: c.alibi, _validate_alibi,
             tolerance="S (the largest absolute score) includes the largest slope times distance",
             score_bound=lambda c, keys: float(alibi_slopes(c.n_heads).max()) * (keys - 1),  # |j - i| < keys
             table=lambda c: alibi_slopes(c.n_heads),
             fault=_drop_alibi, fault_summary="the bias dropped", modern=True),
        Term("causal", ("causal",), "mask", "key j hidden from query i when j > i (token index)",
             lambda c: c.causal, lambda c, set_: _check_bool("causal", c.causal),
             fault=_no_causal_mask, fault_summary="the causal mask dropped", unsaid=True, listed=False,
             sdpa_is_causal=True),
        Term("sliding_window", ("sliding_window",), "mask", "key j hidden from query i when j <= i - W",
             lambda c: c.sliding_window is not None, _validate_window, reach=lambda c: c.sliding_window,
             fault=_window_off_by_one, fault_summary="the window one key wider (W + 1)", modern=True),
        Term("attention_chunk", ("attention_chunk",), "mask",
             "key j hidden from query i unless both are in the same chunk of C tokens, counted from the row's first "
             "unpadded key (Llama 4's chunked layers)",
             lambda c: c.attention_chunk is not None, _validate_chunk, reach=lambda c: c.attention_chunk,
             fault=_chunk_off_by_one, fault_summary="the chunk one key longer (C + 1)", modern=True),
        Term("key_padding_mask", ("key_padding_mask",), "mask", "keys marked True in key_padding_mask hidden",
             lambda c: c.key_padding_mask, lambda c, set_: _check_bool("key_padding_mask", c.key_padding_mask),
             unsaid=True),
        Term("sinks", ("sinks",), "softmax", "one more logit per query head in the softmax (tensor sinks), no value",
             lambda c: c.sinks, lambda c, set_: _check_bool("sinks", c.sinks),
             tensors=lambda c: {"sinks": ((c.n_heads,), (-2.0, 2.0))},
             tolerance="none: one more logit with no value and no error",
             fault=_drop_sinks, fault_summary="the sink logit dropped", modern=True),
    )
}  # fmt: skip
# The modern-LLM terms (docs/concepts/formula.md, "Modern LLM attention"), in the formula's order.
LLM_TERMS = tuple(t.name for t in TERMS.values() if t.modern)


def terms_of(config: AttentionConfig) -> tuple[str, ...]:
    """The terms `config` uses, in the formula's order (TERMS)."""
    return tuple(name for name, t in TERMS.items() if t.uses(config))


def term_tensors(config: AttentionConfig) -> dict[str, tuple[tuple[int, ...], tuple[float, float]]]:
    """{name: (shape, draw range)} of every tensor the config's terms add beside the projections."""
    out: dict[str, tuple[tuple[int, ...], tuple[float, float]]] = {}
    for t in TERMS.values():
        if t.uses(config):
            out.update(t.tensors(config))
    return out


def reach_of(config: AttentionConfig) -> int | None:
    """The nearest reach of the config's mask terms (Term.reach: a query sees no key more than reach - 1 tokens
    before it), None where every query may see every earlier key."""
    reaches = [t.reach(config) for t in TERMS.values() if t.reach is not None and t.uses(config)]
    return min(reaches) if reaches else None


def projection_shapes(config: AttentionConfig) -> dict[str, tuple[tuple[int, int], bool]]:
    """{name: ((out, in), biased)} of the projections that compute q, k and v: q_proj, k_proj and v_proj, or those
    of the term that replaces them (Term.projections)."""
    c = config
    for t in TERMS.values():
        if t.projections is not None and t.uses(c):
            return dict(t.projections(c))
    return {"q_proj": ((c.q_dim, c.d_model), True), "k_proj": ((c.kv_q_dim, c.kv_dim), True),
            "v_proj": ((c.kv_v_dim, c.kv_dim), True)}  # n_kv_heads heads: fewer than n_heads when grouped


def terms_at(config: AttentionConfig, place: str) -> tuple[str, ...]:
    """The terms `config` uses that act at `place` (PLACES), in the formula's order."""
    return tuple(name for name, t in TERMS.items() if t.place == place and t.uses(config))
