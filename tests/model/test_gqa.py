"""Grouped-query attention and the step model's formula: config, weights, torch module, reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnx.errors import ConfigError
from attnx.model import AttentionConfig, init_weights
from attnx.model.module import build_module
from attnx.model.reference import reference_attention
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.model.weights import check_weights, weight_shapes
from attnx.runtimes.compare import compare_arrays


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"n_kv_heads": 3}, "'n_kv_heads' (3) must divide n_heads (4)"),
        ({"n_kv_heads": 0}, "'n_kv_heads' must be positive"),
        ({"n_kv_heads": 2.0}, "'n_kv_heads' must be an integer"),
        ({"kv_cache": True}, "'kv_cache' needs causal self-attention"),
        ({"kv_cache": 1, "causal": True}, "'kv_cache' must be true or false"),
        ({"kv_cache": True, "causal": False, "cross": True}, "'kv_cache' needs causal self-attention"),
    ],
)
def test_bad_decode_keys_name_the_key(kwargs, needle):
    with pytest.raises(ConfigError, match=None) as err:
        AttentionConfig(d_model=32, n_heads=4, **kwargs)
    assert needle in str(err.value)


def test_grouped_weights_shrink_k_and_v():
    c = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, v_head_dim=6)
    shapes = weight_shapes(c)
    assert shapes["k_proj.weight"] == (2 * 8, 32) and shapes["v_proj.weight"] == (2 * 6, 32)
    assert shapes["q_proj.weight"] == (4 * 8, 32) and shapes["out_proj.weight"] == (32, 4 * 6)
    assert c.n_params == sum(int(np.prod(s)) for s in shapes.values())
    assert AttentionConfig(d_model=32, n_heads=4).n_kv_heads == 4  # default: one k/v head per query head
    w = init_weights(AttentionConfig(d_model=32, n_heads=4), 0)  # MHA-shaped k/v: refused for the GQA config
    with pytest.raises(Exception, match="k_proj.weight"):
        check_weights(c, w)


def _expand_to_mha(c: AttentionConfig, w: dict[str, np.ndarray]) -> tuple[AttentionConfig, dict[str, np.ndarray]]:
    """The MHA config and weights in which query head n has its own copy of k/v head n // group."""
    mha = AttentionConfig(**{**c.to_dict(), "n_kv_heads": c.n_heads})
    out = dict(w)
    for name in ("k_proj", "v_proj"):
        for part in ("weight", "bias"):
            heads = np.split(w[f"{name}.{part}"], c.n_kv_heads, axis=0)
            out[f"{name}.{part}"] = np.concatenate([heads[n // c.group_size] for n in range(c.n_heads)], axis=0)
    return mha, out


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_grouped_reference_equals_mha_with_repeated_heads(n_kv_heads):
    c = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, causal=True, key_padding_mask=True)
    w = init_weights(c, 3)
    x = np.random.default_rng(0).standard_normal((2, 7, 32)).astype(np.float32)
    kpm = np.zeros((2, 7), bool)
    kpm[1, :3] = True
    mha, w_mha = _expand_to_mha(c, w)
    y = reference_attention(c, w, x, key_padding_mask=kpm)
    assert np.allclose(y, reference_attention(mha, w_mha, x, key_padding_mask=kpm), rtol=0, atol=1e-12)
    # and differs from a wrong grouping (query head n reading k/v head n % n_kv_heads)
    if n_kv_heads > 1:
        wrong = dict(w_mha)
        for name in ("k_proj", "v_proj"):
            heads = np.split(w[f"{name}.weight"], n_kv_heads, axis=0)
            wrong[f"{name}.weight"] = np.concatenate([heads[n % n_kv_heads] for n in range(4)], axis=0)
        assert not np.allclose(y, reference_attention(mha, wrong, x, key_padding_mask=kpm), atol=1e-6)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_step_by_step_equals_full_forward_in_the_formula(n_kv_heads):
    """The reference and the torch module (float64), prefill then single steps with left padding:
    equal to their own full forward and to each other."""
    c = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=n_kv_heads, causal=True, key_padding_mask=True,
                        kv_cache=True)  # fmt: skip
    w = init_weights(c, 0)
    module = build_module(c, w).double()
    x = np.random.default_rng(1).standard_normal((2, 9, 32))
    kpm = np.zeros((2, 9), bool)
    kpm[1, :4] = True  # left padding: the queries at positions 0..3 of row 1 see no key
    empty = np.zeros((2, n_kv_heads, 0, 8))
    y_full, k_full, v_full = reference_attention(c, w, x, key_padding_mask=kpm, past_key=empty, past_value=empty)
    assert np.allclose(y_full[1, :4], w["out_proj.bias"])  # fully hidden queries: y = bo
    ys, pk, pv = [], empty, empty
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8), (8, 9)):
        y, pk, pv = reference_attention(c, w, x[:, lo:hi], key_padding_mask=kpm[:, :hi], past_key=pk, past_value=pv)
        ys.append(y)
    tol = tolerance_for("fp64")
    size = problem_size(c, w, {"x": x, "past_key": empty})
    for name, got, want in (("y", np.concatenate(ys, 1), y_full), ("k", pk, k_full), ("v", pv, v_full)):
        assert compare_arrays(name, got, want, tol, size)
    with torch.no_grad():
        yt, kt, vt = module(torch.from_numpy(x), key_padding_mask=torch.from_numpy(kpm),
                            past_key=torch.from_numpy(empty), past_value=torch.from_numpy(empty))  # fmt: skip
    for name, got, want in (("y", yt, y_full), ("k", kt, k_full), ("v", vt, v_full)):
        assert compare_arrays(name, got.numpy(), want, tol, size)


def test_decode_presets():
    from attnx.model import preset

    gqa, mqa = preset("large-gqa"), preset("large-mqa")
    assert (gqa.n_heads, gqa.n_kv_heads, gqa.group_size, gqa.kv_cache, gqa.causal) == (16, 4, 4, True, True)
    assert (mqa.n_kv_heads, mqa.group_size, mqa.kv_q_dim) == (1, 16, 64)
    assert AttentionConfig.from_json(gqa.to_json()) == gqa
    assert [s.name for s in gqa.outputs()] == ["y", "present_key", "present_value"]
    assert gqa.inputs()[1].shape == ("batch", 4, "past_seq", 64)
