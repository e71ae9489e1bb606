"""kv_cache: the step model, past keys and values joined before the scores (the formula's cache step)."""

from __future__ import annotations

from attnx.errors import ConfigError
from attnx.model.terms._base import Config, Setter, Term, check_bool


def _validate(c: Config, set_: Setter) -> None:
    check_bool("kv_cache", c.kv_cache)
    if c.kv_cache and not (c.causal and not c.cross):
        raise ConfigError(
            "config key 'kv_cache' needs causal self-attention ('causal': true, 'cross': false): "
            "a cache holds the keys of earlier tokens of the same sequence"
        )


TERM = Term("kv_cache", ("kv_cache",), "cache", "the step model: past keys/values joined before the scores",
            lambda c: c.kv_cache, _validate, unsaid=True)
