"""The terms of the formula as data (attnx.model.terms): every entry has its config keys, its place in the
formula's order and its functions in both array libraries, and the fault each plants is one the
tolerance table tells from the right formula."""

from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from attnx.model import AttentionConfig, init_weights, reference_attention
from attnx.model.inputs import make_inputs
from attnx.model.terms import PLACES, TERMS, term_tensors
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.model.weights import weight_shapes
from attnx.runtimes.compare import compare_arrays
from tests.conftest import LLM_CONFIGS

# Every term with a function uses one; the structural ones (how heads are laid out, the cache) are the
# frame every form writes, not a function of the scores.
STRUCTURAL = {"grouped_heads", "cross", "kv_cache"}
# grouped heads, q/k norms, rope, softcap, ALiBi, causal, window, padding, sinks
ALL_TERMS = dataclasses.replace(LLM_CONFIGS["llm"], alibi=True)
# Llama 4's terms on its two kinds of layer: chunked rope with the norm after it, NoPE with the temperature
TERM_CONFIGS = {"qk_l2_norm": LLM_CONFIGS["llama4"], "attention_chunk": LLM_CONFIGS["llama4"],
                "attn_temperature": LLM_CONFIGS["llama4-nope"],
                # DeepSeek's latent attention (tests/model/test_latent.py)
                "latent": AttentionConfig(d_model=64, n_heads=4, head_dim=24, v_head_dim=16, causal=True,
                                          key_padding_mask=True,
                                          rope={"theta": 10000.0, "dim": 8, "interleaved": True},
                                          latent={"kv_lora_rank": 32, "q_lora_rank": 16, "eps": 1e-6})}  # fmt: skip


def test_every_term_is_in_the_formulas_order_with_its_keys_and_functions():
    fields = {f.name for f in dataclasses.fields(AttentionConfig)}
    places = [PLACES.index(t.place) for t in TERMS.values()]
    assert places == sorted(places), "TERMS is in the formula's order"
    for name, term in TERMS.items():
        assert set(term.keys) <= fields, name
        # one entry a term: its module holds the declaration and both functions (the graph half: test_graph_terms)
        assert importlib.import_module(f"attnx.model.terms.{name}").TERM is term, name
        assert (term.reference is None) == (term.torch is None) == (name in STRUCTURAL), name


def test_every_module_of_the_terms_package_is_an_entry_in_the_order():
    """A term's module left out of _IN_ORDER would be silently no term: every public module is one."""
    import pkgutil

    import attnx.model.terms as package

    modules = {m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")}
    assert modules == set(TERMS) and len(TERMS) == 15


def test_a_configs_terms_and_their_tensors():
    assert ALL_TERMS.terms == ("grouped_heads", "qk_norm", "rope", "softcap", "alibi", "causal", "sliding_window",
                               "key_padding_mask", "sinks")  # fmt: skip
    assert AttentionConfig(d_model=32, n_heads=4).terms == ()
    assert set(term_tensors(ALL_TERMS)) == {"q_norm.weight", "k_norm.weight", "sinks"} <= set(weight_shapes(ALL_TERMS))


@pytest.mark.parametrize("name", [n for n, t in TERMS.items() if t.fault is not None])
def test_each_planted_fault_is_told_from_the_formula(name):
    """The term computed wrong (its entry's fault: a config or weights a check must tell apart) gives
    outputs the tolerance table fails against the right formula's, while the torch module of the right
    config passes: what the audit's and the tests' planted faults rest on."""
    import torch

    from attnx.model import build_module

    config = TERM_CONFIGS.get(name, ALL_TERMS)
    weights = init_weights(config, 3)
    assert TERMS[name].uses(config)
    feeds = make_inputs(config, 2, 12, seed=5)
    ref = reference_attention(config, weights, **feeds)
    size, tol = problem_size(config, weights, feeds), tolerance_for("fp32")
    with torch.no_grad():
        module = build_module(config, weights)
        right = module(torch.from_numpy(feeds["x"]), key_padding_mask=torch.from_numpy(feeds["key_padding_mask"]),
                       **({"position_ids": torch.from_numpy(feeds["position_ids"])} if "position_ids" in feeds
                          else {})).numpy()  # fmt: skip
    assert compare_arrays("y", right, ref, tol, size)
    wrong_config, wrong_weights = TERMS[name].fault(config, weights)
    args = {k: v for k, v in feeds.items() if k in {s.name for s in wrong_config.inputs()}}
    wrong = reference_attention(wrong_config, wrong_weights, **args)
    # rows whose keys are all hidden give z = 0 either way; the others are the fault's
    assert not compare_arrays("y", wrong, ref, tol, size), f"{name}: {TERMS[name].fault_summary} passed"
    assert np.isfinite(wrong).all()


def test_each_term_says_itself_in_a_formula_line_or_is_left_out():
    """Term.said: the one line of attnx optimize's report (formula_said) reads each entry, no branch on a name."""
    from attnx.model import AttentionConfig
    from attnx.model.terms import TERMS
    from attnx.workflows.rewrite.report import formula_said

    c = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, head_dim=24, v_head_dim=16, causal=True,
                        key_padding_mask=True, kv_cache=True, softcap=30.0,
                        rope={"theta": 10000.0, "dim": 8, "interleaved": True})  # fmt: skip
    assert [TERMS[t].said(c) for t in ("grouped_heads", "causal", "kv_cache", "key_padding_mask")] == [None] * 4
    assert TERMS["softcap"].said(c) == "softcap 30.0"
    assert formula_said(c) == "4 heads over 2; head_dim 24; scale 0.2041; rope theta 10000, dim 8, interleaved; softcap 30.0"
    mla = AttentionConfig(d_model=64, n_heads=4, head_dim=24, v_head_dim=16, rope={"theta": 10000.0, "dim": 8},
                          latent={"kv_lora_rank": 32, "q_lora_rank": None, "eps": 1e-6})  # fmt: skip
    assert TERMS["latent"].said(mla) == "latent kv_lora_rank 32, q_proj"
    assert [t for t in TERMS.values() if not t.listed] == [TERMS["causal"]]  # the audit line's one omission
