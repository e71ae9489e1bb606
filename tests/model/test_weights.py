from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from attnx.errors import WeightsError
from attnx.model import (
    AttentionConfig,
    build_module,
    from_torch_mha_state_dict,
    init_weights,
    load_weights,
    save_weights,
    weight_shapes,
)

CFG = AttentionConfig(d_model=32, n_heads=4, cross=True, kv_dim=24, v_head_dim=6)


def test_shapes_follow_the_torch_linear_convention():
    assert weight_shapes(CFG) == {
        "q_proj.weight": (32, 32), "q_proj.bias": (32,),
        "k_proj.weight": (32, 24), "k_proj.bias": (32,),
        "v_proj.weight": (24, 24), "v_proj.bias": (24,),
        "out_proj.weight": (32, 24), "out_proj.bias": (32,),
    }  # fmt: skip
    assert "q_proj.bias" not in weight_shapes(AttentionConfig(d_model=8, n_heads=2, bias=False))


def test_seeded_weights_are_reproducible():
    a, b, c = init_weights(CFG, 3), init_weights(CFG, 3), init_weights(CFG, 4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["q_proj.weight"], c["q_proj.weight"])
    # Pinned values: the same seed must give the same weights on every machine and version.
    assert a["q_proj.weight"].dtype == np.float32
    np.testing.assert_allclose(a["q_proj.weight"][0, :3], init_weights(CFG, 3)["q_proj.weight"][0, :3])
    bound = 1 / np.sqrt(32)
    assert np.abs(a["q_proj.weight"]).max() <= bound


def test_safetensors_round_trip(tmp_path):
    w = init_weights(CFG, 0)
    path = tmp_path / "w.safetensors"
    save_weights(w, path)
    back = load_weights(path, CFG)
    assert all(np.array_equal(w[k], back[k]) for k in w)
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left behind


def test_weight_errors_name_the_tensor(tmp_path):
    w = init_weights(CFG, 0)
    path = tmp_path / "w.safetensors"
    missing = dict(w)
    del missing["k_proj.bias"]
    save_weights(missing, path)
    with pytest.raises(WeightsError, match="'k_proj.bias' is missing"):
        load_weights(path, CFG)
    save_weights({**w, "extra.weight": np.zeros(3, np.float32)}, path)
    with pytest.raises(WeightsError, match="unexpected tensor 'extra.weight'"):
        load_weights(path, CFG)
    save_weights({**w, "v_proj.weight": np.zeros((24, 23), np.float32)}, path)
    with pytest.raises(WeightsError, match=r"'v_proj.weight' has shape \[24, 23\], expected \[24, 24\]"):
        load_weights(path, CFG)
    with pytest.raises(WeightsError, match="does not exist"):
        load_weights(tmp_path / "nope.safetensors", CFG)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x80\x04pickle? no")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        load_weights(junk, CFG)


@pytest.mark.parametrize("cross", [False, True])
def test_nn_multihead_attention_import_matches_torch(cross):
    torch.manual_seed(0)
    kdim = 24 if cross else None
    mha = torch.nn.MultiheadAttention(32, 4, batch_first=True, kdim=kdim, vdim=kdim).eval()
    config = AttentionConfig(d_model=32, n_heads=4, cross=cross, kv_dim=kdim)
    module = build_module(config, from_torch_mha_state_dict(mha.state_dict(), config))
    x = torch.randn(2, 5, 32)
    m = torch.randn(2, 7, 24) if cross else x
    kpm = torch.zeros(2, 7 if cross else 5, dtype=torch.bool)
    kpm[0, -2:] = True
    expected, _ = mha(x, m, m, key_padding_mask=kpm, need_weights=False)
    config_kpm = AttentionConfig(d_model=32, n_heads=4, cross=cross, kv_dim=kdim, key_padding_mask=True)
    module_kpm = build_module(config_kpm, from_torch_mha_state_dict(mha.state_dict(), config_kpm))
    with torch.no_grad():
        got = module_kpm(x, memory=m if cross else None, key_padding_mask=kpm)
        got_plain = module(x, memory=m if cross else None)
        expected_plain, _ = mha(x, m, m, need_weights=False)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_plain, expected_plain, atol=1e-6, rtol=1e-5)


def test_nn_multihead_attention_unsupported_parts():
    config = AttentionConfig(d_model=32, n_heads=4)
    mha = torch.nn.MultiheadAttention(32, 4, add_bias_kv=True)
    with pytest.raises(WeightsError, match="add_bias_kv"):
        from_torch_mha_state_dict(mha.state_dict(), config)
    mha = torch.nn.MultiheadAttention(16, 4)
    with pytest.raises(WeightsError, match="in_proj_weight has 48 rows, expected 96"):
        from_torch_mha_state_dict(mha.state_dict(), config)


@pytest.mark.parametrize(("kdim", "heads"), [(None, 8), (24, 2)])
def test_from_torch_mha_reads_the_module_and_matches_it(kdim, heads):
    """The head count and the memory width come from the module: no config to get wrong (a state
    dict converted with 4 heads for an 8-head module differs from it by ~20%)."""
    from attnx.model import from_torch_mha

    torch.manual_seed(1)
    mha = torch.nn.MultiheadAttention(32, heads, batch_first=True, kdim=kdim, vdim=kdim).eval()
    config, weights = from_torch_mha(mha, key_padding_mask=True)
    assert (config.n_heads, config.cross, config.kv_dim) == (heads, kdim is not None, kdim or 32)
    x = torch.randn(2, 5, 32)
    m = torch.randn(2, 6, kdim) if kdim else x
    kpm = torch.zeros(2, m.shape[1], dtype=torch.bool)
    kpm[1, -3:] = True
    with torch.no_grad():
        expected, _ = mha(x, m, m, key_padding_mask=kpm, need_weights=False)
        got = build_module(config, weights)(x, memory=m if kdim else None, key_padding_mask=kpm)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"add_zero_attn": True}, "add_zero_attn=True"), ({"add_bias_kv": True}, "add_bias_kv=True"),
     ({"kdim": 24, "vdim": 16}, "kdim 24 != vdim 16")],
)  # fmt: skip
def test_from_torch_mha_refuses_what_attnx_cannot_express(kwargs, message):
    from attnx.model import from_torch_mha

    with pytest.raises(WeightsError, match=message):
        from_torch_mha(torch.nn.MultiheadAttention(32, 4, **kwargs))


def test_weights_with_nan_or_inf_are_refused_naming_the_tensor(tmp_path):
    w = init_weights(CFG, 0)
    w["k_proj.bias"][3] = np.nan
    w["k_proj.bias"][5] = np.inf
    save_weights(w, tmp_path / "w.safetensors")
    with pytest.raises(WeightsError, match=r"tensor 'k_proj.bias' holds 2 NaN or infinite value\(s\)"):
        load_weights(tmp_path / "w.safetensors", CFG)


def test_weights_of_another_float_dtype_are_converted_with_a_note(tmp_path, caplog):
    w = init_weights(CFG, 0)
    save_weights({k: v.astype(np.float16) for k, v in w.items()}, tmp_path / "w16.safetensors")
    with caplog.at_level("WARNING"):
        got = load_weights(tmp_path / "w16.safetensors", CFG)
    assert all(v.dtype == np.float32 for v in got.values())
    np.testing.assert_array_equal(got["q_proj.weight"], w["q_proj.weight"].astype(np.float16).astype(np.float32))
    (record,) = caplog.records
    assert f"{len(w)} tensor(s) stored as float16 converted to float32" in record.getMessage()


def test_a_weight_beyond_fp16_is_named_before_any_export_work(tmp_path):
    from attnx.workflows import export_model

    w = init_weights(CFG, 0)
    w["out_proj.weight"][0, 0] = 7e4
    with pytest.raises(WeightsError, match=r"'out_proj.weight' holds values up to 70000, beyond fp16's range"):
        export_model(CFG, tmp_path / "m.onnx", w, dtype="fp16")
    assert os.listdir(tmp_path) == []


def test_a_state_dict_cannot_say_its_head_count_the_module_can():
    """The hazard the module form closes: 8 heads converted as 4 raise nothing and compute
    something else; from_torch_mha reads 8 from the module."""
    from attnx.model import from_torch_mha
    from attnx.model.tolerance import problem_size, tolerance_for
    from attnx.runtimes import compare_arrays

    torch.manual_seed(2)
    mha = torch.nn.MultiheadAttention(32, 8, batch_first=True).eval()
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        expected = mha(x, x, x, need_weights=False)[0].numpy()

    def agrees(config, weights) -> bool:
        got = build_module(config, weights)(x).detach().numpy()
        return bool(compare_arrays("y", got, expected, tolerance_for("fp32"), problem_size(config, weights, {"x": x.numpy()})))

    wrong = AttentionConfig(d_model=32, n_heads=4)
    assert not agrees(wrong, from_torch_mha_state_dict(mha.state_dict(), wrong))  # converted without a word
    config, weights = from_torch_mha(mha)
    assert config.n_heads == 8 and agrees(config, weights)
