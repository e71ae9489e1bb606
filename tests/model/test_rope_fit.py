"""A rotary table read back (attnx.model.rope_fit): the rope a graph computes with, read from its cos/sin table alone,
with no checkpoint: theta^(-2i/dim), a named scaling it matches (linear, llama3, yarn, with their parameters), or
the graph's own table as numbers (rope type "table", with longrope's switch where it has one); and that table as a
config every consumer reads (the reference, uses_long_factors)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnx.errors import ConfigError
from attnx.model import AttentionConfig, reference_attention
from attnx.model.rope import Rope, RopeScaling, parse_rope, rope_frequencies, rope_said, uses_long_factors
from attnx.model.rope_fit import rope_of_table, rope_table_error
from attnx.model.weights import init_weights

ORIGINAL = 64
NAMED = {
    "default": ({"theta": 10000.0}, "theta 10000"),
    "linear": ({"theta": 10000.0, "scaling": {"rope_type": "linear", "factor": 4.0}}, "linear, theta 10000, factor 4"),
    "llama3": ({"theta": 500000.0, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}},
               "llama3, theta 500000, factor 8, low_freq_factor 1, high_freq_factor 4, original 64"),
    "yarn": ({"theta": 150000.0, "scaling": {"rope_type": "yarn", "factor": 32.0,
                                             "original_max_position_embeddings": 4096}},
             "yarn, theta 150000, factor 32, original 4096, beta_fast 32, beta_slow 1, truncate true, "
             "attention_factor 1.34657"),
    "yarn-beta": ({"theta": 150000.0, "scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 4.0,
                                                  "original_max_position_embeddings": 32, "truncate": False}},
                  "yarn, theta 150000, factor 4, original 32, beta_fast 4, beta_slow 1, truncate false, "
                  "attention_factor 1.13863"),
}  # fmt: skip


def _table(rope: Rope, positions: int, seq_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [positions, dim/2] as transformers computes them: float32 inv_freq, float32 angles, times the factor."""
    inv_freq, factor = rope_frequencies(rope, seq_len)
    angles = np.outer(np.arange(positions, dtype=np.float32), inv_freq.astype(np.float32))
    return (np.cos(angles) * np.float32(factor)), (np.sin(angles) * np.float32(factor))


@pytest.mark.parametrize("name", list(NAMED))
@pytest.mark.parametrize("positions", [128, 8192])
def test_a_named_scaling_is_read_from_its_table_alone(name, positions):
    """The table of each named scaling, as a graph computes it, is read as that scaling with its parameters (the
    same config), named in words, whether 128 rows of it are read or 8192."""
    config, said = NAMED[name]
    rope = parse_rope(config, 64)
    read, fit = rope_of_table(*_table(rope, positions), False)
    assert read is not None and fit.matches == said, fit
    if name == "default":
        assert read.scaling is None and abs(read.theta / rope.theta - 1) < 1e-6
    else:
        assert read == rope


def test_a_table_no_named_scaling_fits_is_read_as_the_graphs_own():
    """Frequencies of no named scaling (each theta^(-2i/dim) times its own factor, as longrope's) and an attention
    factor: read as the graph's own table, whose reference table is the graph's within its bound, and which a
    config keeps (JSON and back)."""
    base = parse_rope({"theta": 10000.0}, 16)
    factors = np.array([1.0, 1.1, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0])
    inv_freq = rope_frequencies(base)[0] / factors
    rope = Rope(10000.0, 16, False, RopeScaling("table", (("attention_factor", 1.19), ("inv_freq", tuple(inv_freq)))))
    cos, sin = _table(rope, 128)
    read, fit = rope_of_table(cos, sin, False)
    assert read.rope_type == "table" and fit.matches == "the graph's own table (8 frequencies)" and fit.unread is None
    got, factor = rope_frequencies(read)
    assert rope_table_error(cos, sin, got, factor)[1] <= 1 and abs(factor - 1.19) < 1e-6
    config = AttentionConfig(d_model=32, n_heads=2, causal=True, rope=read)
    assert AttentionConfig.from_dict(config.to_dict()) == config


def test_a_table_that_is_no_rotation_is_not_read():
    """A rotary table with one entry off by 1e-3 (far past float32's rounding) is no rope's: not read, and why."""
    cos, sin = _table(parse_rope({"theta": 10000.0}, 16), 128)
    cos[50, 3] += 1e-3
    read, fit = rope_of_table(cos, sin, False)
    assert read is None and fit.unread.startswith("not read: the table is not cos/sin of position * a frequency")
    assert fit.matches is None


def test_a_table_with_a_long_one_switches_as_longrope_does():
    """A table read with its long one and the length it switches past computes what the longrope it came from
    computes, on either side of that length: the switch (uses_long_factors) and the reference's output."""
    longrope = parse_rope({"theta": 10000.0, "scaling": {
        "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": ORIGINAL,
        "factor": 4.0}}, 16)  # fmt: skip
    (short, factor), (long, _) = rope_frequencies(longrope), rope_frequencies(longrope, ORIGINAL + 1)
    table = Rope(10000.0, 16, False, RopeScaling("table", (
        ("attention_factor", factor), ("inv_freq", tuple(short)), ("long_inv_freq", tuple(long)),
        ("original_max_position_embeddings", ORIGINAL))))  # fmt: skip
    assert parse_rope(table.to_dict(), 16) == table and table.switch_at == longrope.switch_at == ORIGINAL
    assert rope_said(table) == "the graph's own table (8 frequencies, its long one past 64)"
    rng = np.random.default_rng(0)
    config = AttentionConfig(d_model=32, n_heads=2, causal=True, rope=longrope)
    weights = init_weights(config)
    for tokens in (ORIGINAL, ORIGINAL + 1):
        positions = np.arange(tokens)[None]
        assert uses_long_factors(table, positions) == uses_long_factors(longrope, positions) == (tokens > ORIGINAL)
        x = rng.standard_normal((1, tokens, 32))
        want = reference_attention(config, weights, x=x, position_ids=positions)
        got = reference_attention(dataclasses.replace(config, rope=table), weights, x=x, position_ids=positions)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_tables_config_is_checked_key_by_key():
    with pytest.raises(ConfigError, match="'rope.scaling.inv_freq' must be a list of rope.dim / 2 = 8 numbers"):
        parse_rope({"theta": 10000.0, "scaling": {"rope_type": "table", "inv_freq": [1.0, 0.5]}}, 16)
    with pytest.raises(ConfigError, match="'rope.scaling.long_inv_freq' and 'original_max_position_embeddings' go"):
        parse_rope({"theta": 10000.0, "scaling": {"rope_type": "table", "inv_freq": [1.0] * 8,
                                                  "long_inv_freq": [0.5] * 8}}, 16)  # fmt: skip
