from __future__ import annotations

import json
import math

import pytest

from attnx.errors import ConfigError
from attnx.model import PRESETS, AttentionConfig, load_config, preset


def test_defaults_are_resolved():
    c = AttentionConfig(d_model=512, n_heads=8)
    assert (c.head_dim, c.v_head_dim, c.kv_dim) == (64, 64, 512)
    assert c.softmax_scale == pytest.approx(1 / math.sqrt(64))
    assert AttentionConfig(d_model=64, n_heads=4, scale=0.5).softmax_scale == 0.5


def test_json_round_trip_keeps_every_key():
    c = AttentionConfig(d_model=48, n_heads=3, head_dim=20, v_head_dim=7, kv_dim=33, cross=True,
                        key_padding_mask=True, bias=False, scale=0.25)  # fmt: skip
    data = json.loads(c.to_json())
    assert set(data) == {"d_model", "n_heads", "head_dim", "v_head_dim", "kv_dim", "bias", "causal", "cross",
                         "key_padding_mask", "scale", "n_kv_heads", "kv_cache",
                         "rope", "sliding_window", "softcap", "qk_norm", "sinks", "alibi", "qk_l2_norm",
                         "attn_temperature", "attention_chunk", "latent"}  # fmt: skip
    assert AttentionConfig.from_json(c.to_json()) == c


def test_presets_match_the_contract():
    assert (PRESETS["tiny"].d_model, PRESETS["tiny"].n_heads) == (64, 4)
    assert (PRESETS["base"].d_model, PRESETS["base"].n_heads) == (512, 8)
    assert (PRESETS["large"].d_model, PRESETS["large"].n_heads) == (1024, 16)
    g = PRESETS["gpt3"]
    assert (g.d_model, g.n_heads, g.head_dim) == (12288, 96, 128)
    assert g.n_params == 4 * 12288 * 12288 + 4 * 12288  # 604M weights
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"d_model": 64, "n_heads": 4, "colour": 1}, "colour"),
        ({"n_heads": 4}, "d_model"),
        ({"d_model": 0, "n_heads": 4}, "d_model"),
        ({"d_model": -8, "n_heads": 4}, "d_model"),
        ({"d_model": 64, "n_heads": 5}, "head_dim"),
        ({"d_model": 64, "n_heads": "4"}, "n_heads"),
        ({"d_model": 64.0, "n_heads": 4}, "d_model"),
        ({"d_model": 64, "n_heads": True}, "n_heads"),
        ({"d_model": 64, "n_heads": 4, "causal": True, "cross": True}, "causal"),
        ({"d_model": 64, "n_heads": 4, "bias": "yes"}, "bias"),
        ({"d_model": 64, "n_heads": 4, "scale": -1.0}, "scale"),
        ({"d_model": 64, "n_heads": 4, "scale": "big"}, "scale"),
        ({"d_model": 64, "n_heads": 4, "kv_dim": 32}, "kv_dim"),
        ({"d_model": 64, "n_heads": 4, "v_head_dim": 0}, "v_head_dim"),
    ],
)
def test_invalid_values_name_the_key(data, key):
    with pytest.raises(ConfigError, match=repr(key)):
        AttentionConfig.from_dict(data)


def test_non_divisible_d_model_with_head_dim_is_fine():
    c = AttentionConfig(d_model=64, n_heads=5, head_dim=16)
    assert c.q_dim == 80


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"d_model": 32, "n_heads": 2, "causal": True}))
    assert load_config(good) == AttentionConfig(d_model=32, n_heads=2, causal=True)


def test_inputs_follow_the_contract():
    c = AttentionConfig(d_model=32, n_heads=2, cross=True, kv_dim=24, key_padding_mask=True)
    assert [(s.name, s.dtype, s.shape) for s in c.inputs()] == [
        ("x", "fp32", ("batch", "seq", 32)),
        ("memory", "fp32", ("batch", "mem_seq", 24)),
        ("key_padding_mask", "bool", ("batch", "mem_seq")),
    ]
    assert AttentionConfig(d_model=32, n_heads=2, key_padding_mask=True).inputs()[1].shape == ("batch", "seq")
