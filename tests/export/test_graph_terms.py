"""The graph side of each term (attnx.export.terms): its comparison finds the term's planted fault (attnx.model.terms'
fault, where it changes the config) and nothing on the term as its source states it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnx.export.terms import GRAPH_TERMS, Context, MaskReading, Reading, RopeReading, compare_terms, said_by_terms
from attnx.model.config import AttentionConfig
from attnx.model.rope import rope_frequencies
from attnx.model.terms import TERMS
from attnx.model.weights import init_weights

# a config using every term the audit compares (alibi alone: no model has both a rope and ALiBi)
FULL = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, rope={"theta": 10000.0}, sliding_window=4,
                       softcap=30.0, qk_norm={"eps": 1e-6}, sinks=True)  # fmt: skip
ALIBI = AttentionConfig(d_model=64, n_heads=4, causal=True, alibi=True)
# Llama 4's terms, on its chunked rope layer and its NoPE layer
LLAMA4 = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, rope={"theta": 5e5, "interleaved": True},
                         attention_chunk=4, qk_l2_norm=1e-5)  # fmt: skip
NOPE = AttentionConfig(d_model=64, n_heads=4, causal=True, attn_temperature={"floor_scale": 8.0, "attn_scale": 0.1})
SOURCES = {"alibi": ALIBI, "attention_chunk": LLAMA4, "qk_l2_norm": LLAMA4, "attn_temperature": NOPE}


def _reading(config: AttentionConfig) -> Reading:
    """What a reader reads of a graph computing `config` (its rotary table, read at 128 positions)."""
    if config.rope is None:
        return Reading()
    inv_freq, factor = rope_frequencies(config.rope, 128)
    angles = np.arange(128)[:, None] * inv_freq[None]
    return Reading(rope=RopeReading(tables=(np.cos(angles) * factor, np.sin(angles) * factor),
                                    interleaved=config.rope.interleaved))  # fmt: skip


CTX = Context("layer 3", "the checkpoint")


@pytest.mark.parametrize("source", [FULL, ALIBI, LLAMA4, NOPE], ids=["rope-terms", "alibi", "llama4", "nope"])
def test_a_graph_that_states_its_source_s_formula_has_no_finding(source):
    assert compare_terms(source, _reading(source), source, CTX) == []


def _faulted(name: str) -> tuple[AttentionConfig, AttentionConfig]:
    source = SOURCES.get(name, FULL)
    return source, TERMS[name].fault(source, init_weights(source, seed=0))[0]


# the terms whose planted fault changes the config (the others' change weights: the weights' comparison finds them)
CONFIG_FAULTS = [n for n in GRAPH_TERMS if TERMS[n].fault is not None and _faulted(n)[1] != _faulted(n)[0]]


def test_the_faults_compared_here_are_every_config_fault():
    assert set(CONFIG_FAULTS) == {"rope", "qk_l2_norm", "attn_temperature", "softcap", "alibi", "causal",
                                  "sliding_window", "attention_chunk", "sinks"}


@pytest.mark.parametrize("name", CONFIG_FAULTS)
def test_each_term_s_planted_fault_is_its_own_finding(name):
    source, graph = _faulted(name)
    found = compare_terms(graph, _reading(graph), source, CTX)
    assert found and all(f.startswith("layer 3: ") for f in found), found


def test_a_term_missing_from_the_graph_says_its_tensors_once():
    """sinks dropped: one finding of the term; its tensor is not said again by the weights' comparison."""
    graph = dataclasses.replace(FULL, sinks=False)
    assert compare_terms(graph, _reading(graph), FULL, CTX) == ["layer 3: sinks missing from the graph, in the checkpoint"]
    assert said_by_terms(graph, FULL) == {"sinks"}
    assert said_by_terms(FULL, FULL) == set()


def test_alibi_a_graph_does_not_compute_is_a_finding():
    graph = dataclasses.replace(ALIBI, alibi=False)
    assert compare_terms(graph, Reading(), ALIBI, CTX) == ["layer 3: the ALiBi bias missing from the graph, in the checkpoint"]


def test_the_terms_that_read_a_block_s_reading_compare_their_typed_part():
    """rope and the mask terms compare their part of the block's Reading (RopeReading, MaskReading); the rest
    compare the configs alone (reading None), and a part finds what the reader read."""
    block_reading = dataclasses.replace(_reading(FULL), mask=MaskReading("causal, window 5", 5))
    readings = {name: term.reading(block_reading) for name, term in GRAPH_TERMS.items()}
    assert {n for n, r in readings.items() if r is not None} == {"rope", "causal", "sliding_window", "attention_chunk"}
    rope = readings["rope"]
    assert isinstance(rope, RopeReading) and rope is block_reading.rope and rope.interleaved is False
    assert rope.tables_at is None and np.isnan(rope.theta)
    assert readings["causal"] == MaskReading("causal, window 5", 5) == readings["sliding_window"]
    wider = dataclasses.replace(FULL, sliding_window=5)
    assert GRAPH_TERMS["sliding_window"].compares(wider, readings["sliding_window"], FULL, CTX) == [
        "layer 3: window 5 in the graph (local_window_size 5), sliding_window 4 in the checkpoint"]
    flipped = GRAPH_TERMS["rope"].compares(FULL, dataclasses.replace(rope, interleaved=True), FULL, CTX)
    assert flipped == ["layer 3: rotary_interleaved 1 in the graph, the checkpoint's rope pairs (i, i+dim/2)"]
