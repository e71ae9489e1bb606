"""What every term's entry is built from: the Term record, the places of the formula, and the checks and numpy
helpers its modules share (attnx.model.terms's doc says what an entry holds)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.errors import ConfigError

# Where a term acts, in the formula's order:
#   heads     how the projections are laid out (grouped key/value heads, a second sequence)
#   qk        q and k before they are scored and cached: per head, [batch, seq, heads, head_dim]
#   cache     the keys and values of earlier steps joined before the scores
#   scores    s = scale * q.k, then each score term in order: s [.., queries, keys]
#   mask      which keys a query sees (over token index): the union of what each hides
#   softmax   more logits in the softmax's denominator, with no value
PLACES = ("heads", "qk", "cache", "scores", "mask", "softmax")

Config = Any  # an AttentionConfig (config.py imports this package: the type is named in TYPE_CHECKING only)
Weights = dict[str, np.ndarray]
Setter = Callable[[str, Any], None]  # validate's set_(key, value): a key's normal form into the frozen config


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


def check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")


def self_attention_only(c: Config, key: str) -> None:
    """One ConfigError where a term of self-attention is set on a cross-attention config (`cross`)."""
    if c.cross:
        raise ConfigError(f"config key {key!r} is for self-attention ('cross': false)")


def number_object(key: str, value: Any, cls: type) -> Any:
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


def replace(c: Config, **changes: Any) -> Config:
    return dataclasses.replace(c, **changes)


# The numpy reference's helpers (attnx.model.reference), shared with the terms that project.
def rms(u: np.ndarray, eps: float) -> np.ndarray:
    """u over the root of its mean square (+ eps) along the last axis."""
    return u / np.sqrt(np.mean(u**2, axis=-1, keepdims=True) + u.dtype.type(eps))


def linear(c: Config, weights: Mapping[str, np.ndarray], inp: np.ndarray, name: str) -> np.ndarray:
    """inp @ W.T (+ b with the config's `bias`): a torch Linear, W [out, in]."""
    # Each tensor is made the compute dtype when used, not all up front: a float64 copy of every
    # weight would be 4.8 GB for the gpt3 preset (2x its float32 weights).
    out = inp @ np.asarray(weights[f"{name}.weight"], dtype=inp.dtype).T
    if c.bias:
        out = out + np.asarray(weights[f"{name}.bias"], dtype=inp.dtype)
    return out


def matmul(w: Mapping[str, np.ndarray], inp: np.ndarray, name: str) -> np.ndarray:
    return inp @ np.asarray(w[f"{name}.weight"], dtype=inp.dtype).T  # a projection without bias


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of the formula (attnx.model.terms's doc): its declaration and its functions."""

    name: str
    keys: tuple[str, ...]
    place: str
    summary: str  # what it computes, one line (the docs' tables: docs/reference/capabilities.md)
    uses: Callable[[Config], bool]
    validate: Callable[[Config, Setter], None] = lambda c, set_: None
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
    # The term computed, by its place (attnx.model.terms's doc): the numpy reference's float64 function and the torch
    # module's; None where another part computes it (the heads, the cache: the formula's own steps). The heads term
    # that projects (latent) has a pair of each: (project x -> q and what the cache holds, expand that -> k, v).
    reference: Any = None
    torch: Any = None
    stage: str | None = None  # the stage its q/k output is (attnx.model.stages: q_<stage>, k_<stage>), if one

    def said(self, c: Config) -> str | None:
        """The term in a formula's one line, with its values (a value of True or None unsaid); None: left out."""
        if self.unsaid:
            return None
        values = self.says(c) if self.says is not None else [getattr(c, key) for key in self.keys]
        out = ", ".join(str(v) for v in values if v is not None and v is not True)
        return f"{self.name} {out}" if out else self.name
