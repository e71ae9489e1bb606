"""grouped_heads: n_kv_heads key/value heads, each read by a group of query heads (the formula lays them out)."""

from __future__ import annotations

import numpy as np

from attnx.errors import ConfigError
from attnx.model.terms._base import Config, Setter, Term, Weights, check_int


def _validate(c: Config, set_: Setter) -> None:
    if c.n_kv_heads is None:
        set_("n_kv_heads", c.n_heads)
    check_int("n_kv_heads", c.n_kv_heads)
    if c.n_heads % c.n_kv_heads:
        raise ConfigError(
            f"config key 'n_kv_heads' ({c.n_kv_heads}) must divide n_heads ({c.n_heads}): "
            "each key/value head serves an equal group of query heads"
        )


def _permute_kv_heads(c: Config, w: Weights) -> tuple[Config, Weights]:
    """Key head g computed from head g+1's weights (query heads read the wrong group's keys)."""
    out = dict(w)
    rows = np.asarray(w["k_proj.weight"]).reshape(c.n_kv_heads, c.head_dim, -1)
    out["k_proj.weight"] = np.roll(rows, 1, axis=0).reshape(w["k_proj.weight"].shape)
    if c.bias:
        out["k_proj.bias"] = np.roll(np.asarray(w["k_proj.bias"]).reshape(c.n_kv_heads, -1), 1, axis=0).ravel()
    return c, out


TERM = Term("grouped_heads", ("n_kv_heads",), "heads",
            "n_kv_heads key/value heads, each read by a group of n_heads / n_kv_heads query heads",
            lambda c: c.n_kv_heads != c.n_heads, _validate,
            fault=_permute_kv_heads, fault_summary="key/value heads permuted (k_proj rows rolled by one head)",
            unsaid=True)  # fmt: skip
