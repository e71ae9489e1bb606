"""cross: keys and values projected from a second sequence, memory (the formula's projections)."""

from __future__ import annotations

from attnx.errors import ConfigError
from attnx.model.terms._base import Config, Setter, Term, check_bool, check_int


def _validate(c: Config, set_: Setter) -> None:
    check_bool("cross", c.cross)
    if c.kv_dim is None:
        set_("kv_dim", c.d_model)
    check_int("kv_dim", c.kv_dim)
    if c.causal and c.cross:
        raise ConfigError("config keys 'causal' and 'cross' cannot both be true: the causal mask is for self-attention")
    if not c.cross and c.kv_dim != c.d_model:
        raise ConfigError(f"config key 'kv_dim' ({c.kv_dim}) must equal d_model ({c.d_model}) without 'cross'")


TERM = Term("cross", ("cross", "kv_dim"), "heads", "keys and values projected from a second sequence, memory",
            lambda c: c.cross, _validate)
