"""ALiBi in the ground layer (issue 30): the slopes against transformers' own functions (BLOOM, MPT,
Falcon), the reference's term against a direct numpy formula (full sequence and step by step), the
torch module (both cores, fp32) against the reference, the config key, and the forms refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from attnx.errors import ConfigError, UsageError
from attnx.model import AttentionConfig, build_module, init_weights, reference_attention
from attnx.model.alibi import alibi_slopes
from attnx.model.cores import form_of
from attnx.model.inputs import make_inputs
from attnx.model.terms import TERMS
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays

EPS32 = float(np.finfo(np.float32).eps)
# Head counts that are and are not powers of two; grouped heads, softcap and a window beside ALiBi.
CONFIGS = {
    "causal-4": AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True, alibi=True),
    "causal-6": AttentionConfig(d_model=24, n_heads=6, causal=True, key_padding_mask=True, alibi=True),
    "bidirectional-12": AttentionConfig(d_model=48, n_heads=12, key_padding_mask=True, alibi=True),
    "grouped-softcap-window": AttentionConfig(d_model=48, n_heads=6, n_kv_heads=2, head_dim=8, causal=True,
                                              softcap=2.0, sliding_window=4, alibi=True),  # fmt: skip
}
STEP = AttentionConfig(d_model=48, n_heads=6, head_dim=8, causal=True, kv_cache=True, alibi=True)


# The slopes ------------------------------------------------------------------------------------
def test_slopes_follow_the_paper():
    """2^(-8k/n) for a power of two n; else the largest power p's, then 2p's at odd k."""
    assert alibi_slopes(1).tolist() == [2.0**-8]
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    np.testing.assert_array_equal(alibi_slopes(12)[8:], 2.0 ** (-np.array([1, 3, 5, 7]) / 2))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            alibi_slopes(bad)


def test_slopes_match_transformers_for_1_to_40_heads():
    """BLOOM's _get_alibi_slopes (float32 base^k: k + 1 roundings of eps/2 at most), MPT's
    build_mpt_alibi_tensor at its bias max 8 (a float32 exponent, a power and a division: within
    (8 + 2) eps), and Falcon's build_alibi_tensor, which rounds them to bfloat16 (its values at position
    1 are bf16(slope))."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    assert transformers.__version__.startswith("5.")
    for n in range(1, 41):
        ours = alibi_slopes(n)
        k = np.arange(1, n + 1)  # at least the power each of BLOOM's slopes is raised to
        bloom = _get_alibi_slopes(n, "cpu").double().numpy()
        np.testing.assert_array_less(np.abs(bloom - ours), (k + 1) * EPS32 / 2 * ours, err_msg=f"bloom {n}")
        mpt = -build_mpt_alibi_tensor(n, 2)[:, 0, 0].double().numpy()  # key 0 of 2: slope * (0 - 1)
        np.testing.assert_array_less(np.abs(mpt - ours), 10 * EPS32 * ours, err_msg=f"mpt {n}")
        falcon = falcon_alibi(torch.ones(1, 2, dtype=torch.long), n, torch.float32)[:, 0, 1].double().numpy()
        np.testing.assert_array_equal(falcon, torch.tensor(ours).bfloat16().double().numpy(), err_msg=f"falcon {n}")


# The reference against a direct formula -----------------------------------------------------------
def _direct(c: AttentionConfig, w, x, kpm=None):
    """softmax_j(scale q_i.k_j + slope_h (j - i) + mask) v_j, every head at once (float64), for
    configs without softcap, window or grouped heads; a row with no visible key gives z = 0."""
    x = x.astype(np.float64)
    B, T, _ = x.shape
    N, hd = c.n_heads, c.head_dim

    def proj(name):
        return (x @ w[f"{name}.weight"].astype(np.float64).T + w[f"{name}.bias"]).reshape(B, T, N, -1)

    q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = c.softmax_scale * np.einsum("bind,bjnd->bnij", q, k) + alibi_slopes(N)[:, None, None] * (j - i)
    hidden = np.zeros((B, 1, T, T), bool)
    if c.causal:
        hidden |= j > i
    if kpm is not None:
        hidden |= kpm[:, None, None, :]
    s = np.where(hidden, -np.inf, s)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0))
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)  # a fully hidden row: all zeros
    z = np.einsum("bnij,bjnd->bind", p, v).reshape(B, T, N * hd)
    return z @ w["out_proj.weight"].astype(np.float64).T + w["out_proj.bias"]


@pytest.mark.parametrize("name", ["causal-4", "causal-6", "bidirectional-12"])
def test_reference_adds_slope_times_distance_over_token_index(name):
    c = CONFIGS[name]
    w = init_weights(c, 1)
    feeds = make_inputs(c, 3, 9, seed=4)
    want = _direct(c, w, feeds["x"], feeds.get("key_padding_mask"))
    np.testing.assert_allclose(reference_attention(c, w, **feeds), want, rtol=0, atol=1e-12 * np.abs(want).max())
    plain = reference_attention(dataclasses.replace(c, alibi=False), w, **feeds)
    assert np.abs(plain - want).max() > 1e-2  # the term is there


def test_reference_step_puts_the_query_at_past_plus_i():
    """A prefill of 5 then single tokens (kv_cache) gives the full sequence's y: query i of a step
    sits at token index past + i."""
    full = CONFIGS["causal-6"]
    step = dataclasses.replace(full, kv_cache=True)
    w = init_weights(full, 2)
    feeds = make_inputs(full, 3, 8, seed=5)
    want = _direct(full, w, feeds["x"], feeds["key_padding_mask"])
    k = v = np.zeros((3, full.n_heads, 0, full.head_dim))
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
        y, k, v = reference_attention(step, w, feeds["x"][:, start:stop], key_padding_mask=feeds["key_padding_mask"][:, :stop],
                                      past_key=k, past_value=v)  # fmt: skip
        np.testing.assert_allclose(y, want[:, start:stop], rtol=0, atol=1e-12 * np.abs(want).max())


# The module against the reference -----------------------------------------------------------------
def _torch(module, feeds):
    with torch.no_grad():
        out = module(**{key: torch.from_numpy(value) for key, value in feeds.items()})
    return out.numpy() if isinstance(out, torch.Tensor) else tuple(t.numpy() for t in out)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_module_matches_reference(name):
    c = CONFIGS[name]
    w = init_weights(c, 1)
    cores = ["decomposed"] + (["sdpa"] if c.softcap is None else [])  # the sdpa core: ALiBi as a float mask
    for batch, seq in ((1, 1), (3, 9), (2, 33)):
        feeds = make_inputs(c, batch, seq, seed=seq)
        ref = reference_attention(c, w, **feeds)
        for core in cores:
            cmp = compare_arrays("y", _torch(build_module(c, w, core=core), feeds), ref, tolerance_for("fp32"),
                                 problem_size(c, w, feeds))  # fmt: skip
            assert cmp, f"{core} {batch}x{seq}: {cmp}"


@pytest.mark.parametrize("core", ["decomposed", "sdpa"])
def test_module_step_matches_reference(core):
    c = dataclasses.replace(CONFIGS["causal-6"], kv_cache=True)
    w = init_weights(c, 3)
    feeds = make_inputs(c, 3, 8, seed=6)
    module = build_module(c, w, core=core)
    k = v = np.zeros((3, c.n_heads, 0, c.head_dim), np.float32)
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
        args = {"x": feeds["x"][:, start:stop], "key_padding_mask": feeds["key_padding_mask"][:, :stop],
                "past_key": k, "past_value": v}  # fmt: skip
        y, k, v = _torch(module, args)
        cmp = compare_arrays("y", y, reference_attention(c, w, **args)[0], tolerance_for("fp32"), problem_size(c, w, args))
        assert cmp, f"{core} step {start}:{stop}: {cmp}"


def test_a_wrong_slope_or_distance_fails_the_comparison(monkeypatch):
    """The tolerance (whose S includes ALiBi's largest bias) still catches the term's faults: every
    slope halved, the sign turned (i - j), the term dropped. (A distance off by a constant, the query at
    past + i + 1, is no fault: it moves a row's scores alike, and softmax does not see it.)"""
    c = CONFIGS["causal-6"]
    w = init_weights(c, 1)
    feeds = make_inputs(c, 3, 33, seed=2)
    size, tol = problem_size(c, w, feeds), tolerance_for("fp32")
    import attnx.model.terms.alibi as term_file

    module = build_module(c, w)
    ref = reference_attention(c, w, **feeds)
    assert compare_arrays("y", _torch(module, feeds), ref, tol, size)
    for wrong in (alibi_slopes(6) / 2, -alibi_slopes(6)):  # the slopes the module's term reads, planted wrong
        monkeypatch.setattr(term_file, "alibi_slopes", lambda n, wrong=wrong: wrong)
        assert not compare_arrays("y", _torch(module, feeds), ref, tol, size)
    monkeypatch.setattr(term_file, "alibi_slopes", alibi_slopes)
    right = term_file.TERM.torch
    shifted = dataclasses.replace(term_file.TERM, torch=lambda m, s, i, j: right(m, s, i + 1, j))  # past + i + 1
    monkeypatch.setitem(TERMS, "alibi", shifted)
    assert compare_arrays("y", _torch(module, feeds), ref, tol, size)
    plain = reference_attention(dataclasses.replace(c, alibi=False), w, **feeds)
    assert not compare_arrays("y", plain, ref, tol, size)


# The config and the forms ---------------------------------------------------------------------------
def test_the_config_key():
    c = CONFIGS["causal-6"]
    assert AttentionConfig.from_json(c.to_json()) == c and c.to_dict()["alibi"] is True
    assert AttentionConfig(d_model=8, n_heads=2).alibi is False and c.llm_keys == ("alibi",)
    with pytest.raises(ConfigError, match="'alibi' must be true or false"):
        AttentionConfig(d_model=8, n_heads=2, alibi=1)
    with pytest.raises(ConfigError, match="'alibi' is for self-attention"):
        AttentionConfig(d_model=8, n_heads=2, cross=True, alibi=True)


@pytest.mark.parametrize("name", ["causal-6", "step-6", "grouped-softcap-window"])
def test_every_core_that_takes_the_term_writes_it_and_the_others_refuse(name):
    """The registry's cores with ALiBi (attnx.model.cores: an Add in the decomposed core, a float attn_mask
    of the opset-23 Attention, MultiHeadAttention's and GroupQueryAttention's attention_bias), full
    sequence and step, each against the reference; the ones without it refuse by name."""
    import onnxruntime as ort

    from attnx.export import build_model
    from attnx.model.cores import CORES, LOWERINGS, core_for, lowerings_for, why_not
    from attnx.model.tolerance import problem_size, tolerance_for
    from attnx.runtimes.compare import compare_arrays

    c = STEP if name == "step-6" else CONFIGS[name]
    w = init_weights(c, 0)
    written = lowerings_for(c)
    assert {"decomposed", "onnx", "ort-fused"} <= set(written)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 4, c.d_model)).astype(np.float32)}
    if c.kv_cache:  # one token a row after a past of 5 (GroupQueryAttention's chunks are one row's)
        feeds = {"x": feeds["x"][:, :1], **{f"past_{n}": rng.standard_normal((2, c.n_kv_heads, 5, c.head_dim))
                                            .astype(np.float32) for n in ("key", "value")}}  # fmt: skip
    if c.key_padding_mask:
        feeds["key_padding_mask"] = np.zeros((2, feeds["x"].shape[1]), bool)
        feeds["key_padding_mask"][1, 0] = True
    ref = reference_attention(c, w, **feeds)
    ref = ref[0] if c.kv_cache else ref
    for lowering in written:
        model = build_model(c, w, lowering)
        (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y"], feeds)
        assert compare_arrays("y", y, ref, tolerance_for("fp32"), problem_size(c, w, feeds)), lowering
        assert why_not(core_for(lowering, c), c) == []
    for lowering in set(LOWERINGS) - set(written):  # refused: naming alibi where its cores lack it
        cores = LOWERINGS[lowering].cores.get(form_of(c), ())
        with pytest.raises(UsageError) as info:
            core_for(lowering, c)
        assert ("alibi" in str(info.value)) == any(not CORES[k].takes("alibi", form_of(c)) for k in cores)
    if c.kv_cache:
        with pytest.raises(UsageError, match="GroupQueryAttention does not express alibi in the buffer form"):
            core_for("ort-fused", c, form="buffer")
