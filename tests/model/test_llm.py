"""Modern LLM attention in the ground layer: the config keys (rope, sliding_window, softcap, qk_norm,
sinks), their weights, the torch module against the float64 reference with each term alone and all
together, the step (kv_cache) against the full sequence, the tolerance's rope term, and planted
faults in each term that the comparison must catch."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from attnx.errors import ConfigError, UsageError, WeightsError
from attnx.model import (
    PRESETS,
    AttentionConfig,
    build_module,
    init_weights,
    load_weights,
    reference_attention,
    save_weights,
)
from attnx.model.cores import core_for
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
BASE = dict(d_model=48, n_heads=4, n_kv_heads=2, head_dim=12, causal=True)
# Each term alone, then all together (with grouped heads, key padding, partial interleaved rotary).
LLM_CONFIGS: dict[str, AttentionConfig] = {
    "rope": AttentionConfig(**BASE, rope={"theta": 10000.0}),
    "rope_llama3": AttentionConfig(**BASE, bias=False, rope={"theta": 500000.0, "scaling": LLAMA3}),
    "window": AttentionConfig(**BASE, sliding_window=3),
    "softcap": AttentionConfig(**BASE, softcap=1.0),
    "qk_norm": AttentionConfig(**BASE, qk_norm={"eps": 1e-6}),
    "sinks": AttentionConfig(**BASE, sinks=True),
    "all": AttentionConfig(
        **BASE,
        key_padding_mask=True,
        sliding_window=4,
        softcap=2.0,
        qk_norm={"eps": 1e-5},
        sinks=True,
        rope={
            "theta": 1000.0,
            "dim": 8,
            "interleaved": True,
            "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        },
    ),  # fmt: skip
}
SHAPES = ((1, 1, 0), (3, 9, 0), (2, 21, 40))  # (batch, seq, position offset)


def _torch(module, feeds):
    with torch.no_grad():
        out = module(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    return out.numpy() if isinstance(out, torch.Tensor) else tuple(t.numpy() for t in out)


def _compare(config, weights, y, feeds, ref=None):
    ref = reference_attention(config, weights, **feeds) if ref is None else ref
    return compare_arrays("y", y, ref, tolerance_for("fp32"), problem_size(config, weights, feeds))


# The config ------------------------------------------------------------------------------------
def test_llm_keys_round_trip_with_defaults_resolved():
    c = LLM_CONFIGS["all"]
    data = json.loads(c.to_json())
    assert data["rope"]["scaling"] == {  # yarn's defaults written as numbers: the config says what runs
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": True, "attention_factor": pytest.approx(0.1 * np.log(4.0) + 1),
    }  # fmt: skip
    assert (data["sliding_window"], data["softcap"], data["qk_norm"], data["sinks"]) == (4, 2.0, {"eps": 1e-5}, True)
    assert AttentionConfig.from_json(c.to_json()) == c
    assert dataclasses.replace(c, sinks=False).llm_keys == ("qk_norm", "rope", "softcap", "sliding_window")  # the formula's order
    assert AttentionConfig(d_model=8, n_heads=2, rope={"theta": 10.0}).rope.dim == 4  # null dim = head_dim
    assert AttentionConfig(d_model=8, n_heads=2).llm_keys == ()
    old = {"rope": {"theta": 1e4, "scaling": {"type": "linear", "factor": 2}}}  # transformers' older key
    assert AttentionConfig(d_model=8, n_heads=2, **old).rope.scaling.rope_type == "linear"
    assert [s.name for s in LLM_CONFIGS["all"].inputs()] == ["x", "key_padding_mask", "position_ids"]
    assert LLM_CONFIGS["all"].inputs()[-1].dtype == "int64"


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"rope": {"theta": 1e4, "scaling": {"rope_type": "dynamic", "factor": 2.0}}}, "dynamic NTK"),
        ({"rope": {"theta": 1e4, "scaling": {"rope_type": "ntk"}}}, "rope.scaling.rope_type"),
        ({"rope": {"theta": 1e4, "dim": 5}}, "rope.dim"),
        ({"rope": {"theta": 1e4, "dim": 16}}, "rope.dim"),
        ({"rope": {"dim": 4}}, "rope.theta"),
        ({"rope": {"theta": 1e4, "base": 3}}, "rope.base"),
        ({"rope": {"theta": 1e4, "interleaved": 1}}, "rope.interleaved"),
        ({"rope": {"theta": 1e4, "scaling": {"rope_type": "linear"}}}, "rope.scaling.factor"),
        ({"rope": {"theta": 1e4, "scaling": {"rope_type": "linear", "factor": -2.0}}}, "rope.scaling.factor"),
        ({"rope": {"theta": 1e4, "scaling": {**LLAMA3, "high_freq_factor": 0.5}}}, "rope.scaling.high_freq_factor"),
        ({"rope": {"theta": 1e4, "scaling": {**LLAMA3, "beta_fast": 3}}}, "rope.scaling.beta_fast"),
        (
            {
                "rope": {
                    "theta": 1e4,
                    "scaling": {
                        "rope_type": "longrope",
                        "short_factor": [1.0],
                        "long_factor": [1.0] * 4,
                        "original_max_position_embeddings": 8,
                        "factor": 2.0,
                    },
                }
            },
            "rope.scaling.short_factor",
        ),  # fmt: skip
        (
            {
                "rope": {
                    "theta": 1e4,
                    "scaling": {
                        "rope_type": "longrope",
                        "short_factor": [1.0] * 4,
                        "long_factor": [1.0] * 4,
                        "original_max_position_embeddings": 8,
                    },
                }
            },
            "rope.scaling.attention_factor",
        ),  # fmt: skip
        ({"rope": [10000.0]}, "rope"),
        ({"sliding_window": 0, "causal": True}, "sliding_window"),
        ({"sliding_window": 4}, "sliding_window"),  # needs causal
        ({"softcap": 0.0}, "softcap"),
        ({"softcap": "30"}, "softcap"),
        ({"qk_norm": {"eps": -1.0}}, "qk_norm.eps"),
        ({"qk_norm": {"epsilon": 1e-6}}, "qk_norm"),
        ({"sinks": 1}, "sinks"),
    ],
)
def test_invalid_llm_values_name_the_key(extra, key):
    with pytest.raises(ConfigError, match=key):
        AttentionConfig.from_dict({"d_model": 16, "n_heads": 2, **extra})


def test_llm_presets():
    llama = PRESETS["llama3-8b"]
    assert (llama.d_model, llama.n_heads, llama.n_kv_heads, llama.head_dim, llama.bias) == (4096, 32, 8, 128, False)
    assert (llama.rope.theta, llama.rope.dim, llama.rope.rope_type) == (500000.0, 128, "llama3")
    assert llama.rope.scaling.to_dict() == {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                                            "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192}  # fmt: skip
    gemma = PRESETS["gemma2-9b"]
    assert (gemma.d_model, gemma.n_heads, gemma.n_kv_heads, gemma.head_dim) == (3584, 16, 8, 256)
    assert (gemma.sliding_window, gemma.softcap, gemma.softmax_scale, gemma.rope.theta) == (4096, 50.0, 1 / 16, 1e4)


# Weights --------------------------------------------------------------------------------------
def test_llm_weights_are_drawn_saved_and_checked_by_name(tmp_path):
    c = LLM_CONFIGS["all"]
    w = init_weights(c, 3)
    assert w["q_norm.weight"].shape == w["k_norm.weight"].shape == (12,) and w["sinks"].shape == (4,)
    assert 0.5 <= w["q_norm.weight"].min() and w["q_norm.weight"].max() < 1.5 and np.ptp(w["sinks"]) > 0
    plain = init_weights(dataclasses.replace(c, qk_norm=None, sinks=False), 3)  # the projections' draws unchanged
    assert all(np.array_equal(plain[k], w[k]) for k in plain)
    save_weights(w, tmp_path / "w.safetensors")
    assert all(np.array_equal(v, w[k]) for k, v in load_weights(tmp_path / "w.safetensors", c).items())
    with pytest.raises(WeightsError, match="'sinks' is missing"):
        save_weights({k: v for k, v in w.items() if k != "sinks"}, tmp_path / "bad.safetensors")
        load_weights(tmp_path / "bad.safetensors", c)
    with pytest.raises(WeightsError, match=r"'k_norm.weight' has shape \[4\]"):
        build_module(c, {**w, "k_norm.weight": np.ones(4, np.float32)})
    with pytest.raises(WeightsError, match="unexpected tensor 'sinks'"):
        build_module(dataclasses.replace(c, sinks=False), w | {"q_norm.weight": w["q_norm.weight"]})


# The module against the reference ------------------------------------------------------------
@pytest.mark.parametrize("name", list(LLM_CONFIGS))
def test_module_matches_reference(name):
    config = LLM_CONFIGS[name]
    w = init_weights(config, 1)
    cores = ["decomposed"] + (["sdpa"] if config.softcap is None and not config.sinks else [])
    modules = {core: build_module(config, w, core=core) for core in cores}
    f64 = build_module(config, w).double()  # an independent implementation of the same formula
    for batch, seq, offset in SHAPES:
        feeds = make_inputs(config, batch, seq, seed=seq, position_offset=offset)
        ref = reference_attention(config, w, **feeds)
        for core, module in modules.items():
            cmp = _compare(config, w, _torch(module, feeds), feeds, ref)
            assert cmp, f"{core}: {cmp}"
        y64 = _torch(f64, {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()})
        np.testing.assert_allclose(y64, ref, rtol=0, atol=1e-12 * np.abs(ref).max())


def test_sdpa_core_refuses_what_it_cannot_express():
    for name in ("softcap", "sinks"):
        with pytest.raises(UsageError, match=f"sdpa core has no {name}"):
            build_module(LLM_CONFIGS[name], core="sdpa")


def test_fully_hidden_row_with_sinks_gives_output_bias():
    config = LLM_CONFIGS["all"]
    w = init_weights(config, 1)
    feeds = make_inputs(config, 2, 6, seed=0)
    assert feeds["key_padding_mask"][1].all()
    for y in (_torch(build_module(config, w), feeds), reference_attention(config, w, **feeds)):
        np.testing.assert_allclose(y[1], np.broadcast_to(w["out_proj.bias"], y[1].shape), atol=1e-6)


def test_positions_follow_hugging_face_padding():
    """position_ids: cumsum of the attended tokens - 1, 1 on the padding; the masks stay over token
    index (a left-padded element's y is its unpadded y at the same positions)."""
    c = LLM_CONFIGS["rope"]
    feeds = make_inputs(c, 3, 6, seed=0, position_offset=10)
    assert feeds["position_ids"].tolist() == [[10, 11, 12, 13, 14, 15], [11, 11, 10, 11, 12, 13],
                                              [11, 11, 11, 11, 10, 11]]  # fmt: skip
    kpm = make_inputs(LLM_CONFIGS["all"], 1, 5, seed=4)
    attended = ~kpm["key_padding_mask"][0]
    assert kpm["position_ids"][0][attended].tolist() == list(range(attended.sum()))


@pytest.mark.parametrize("name", ["all", "rope_llama3"])
def test_step_model_matches_full_sequence(name):
    """The reference's and the module's step (kv_cache: keys cached after qk_norm and rope, the
    window over token index) give the full forward's y, prefill 5 then single tokens."""
    full_config = LLM_CONFIGS[name]
    config = dataclasses.replace(full_config, kv_cache=True)
    w = init_weights(config, 2)
    feeds = make_inputs(full_config, 2, 8, seed=5, position_offset=3)
    want = reference_attention(full_config, w, **feeds)
    module = build_module(config, w)
    caches = {"reference": None, "torch": None}
    for start, stop in ((0, 5), (5, 6), (6, 7), (7, 8)):
        step = {"x": feeds["x"][:, start:stop], "position_ids": feeds["position_ids"][:, start:stop]}
        if "key_padding_mask" in feeds:
            step["key_padding_mask"] = feeds["key_padding_mask"][:, :stop]
        for impl, cache in caches.items():
            past = cache or (np.zeros((2, 2, 0, 12), np.float32),) * 2
            args = {**step, "past_key": past[0].astype(np.float32), "past_value": past[1].astype(np.float32)}
            y, k, v = reference_attention(config, w, **args) if impl == "reference" else _torch(module, args)
            caches[impl] = (k, v)
            cmp = compare_arrays("y", y, want[:, start:stop], tolerance_for("fp32"), problem_size(config, w, args))
            assert cmp, f"{impl} step {start}:{stop}: {cmp}"


# The tolerance's rope term, and faults it must not hide ---------------------------------------
def test_rope_term_grows_with_the_position_and_passes_at_8192():
    c = LLM_CONFIGS["rope_llama3"]
    w = init_weights(c, 1)
    module = build_module(c, w)
    sizes = {}
    for offset in (0, 8192):
        feeds = make_inputs(c, 2, 17, seed=1, position_offset=offset)
        sizes[offset] = problem_size(c, w, feeds)
        cmp = _compare(c, w, _torch(module, feeds), feeds)
        assert cmp, str(cmp)
        assert cmp.max_abs < 0.1 * cmp.atol  # the bound is not what passes it (measured ~0.01 of it)
    assert sizes[8192].rope_position == 8192 + 16 and sizes[0].rope_position == 16
    assert problem_size(LLM_CONFIGS["window"], init_weights(LLM_CONFIGS["window"], 1),
                        make_inputs(LLM_CONFIGS["window"], 1, 4)).rope_position == 0  # fmt: skip


class _WrongAxisNorm(torch.nn.Module):
    """A planted fault: the q/k RMSNorm over the heads of a token, not over head_dim."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, u):  # (B, T, heads, hd)
        return u * torch.rsqrt(u.pow(2).mean(-2, keepdim=True) + self.norm.eps) * self.norm.weight


def _faulty_y(config, w, feeds):
    """{fault: y} for each new term the config has: computed by the torch module with that fault."""
    module = build_module(config, w)
    out = {}
    if config.rope is not None:
        rope = config.rope.to_dict()
        flipped = dataclasses.replace(config, rope={**rope, "interleaved": not rope["interleaved"]})
        out["the other pair layout"] = _torch(build_module(flipped, w), feeds)
        index = np.broadcast_to(np.arange(feeds["x"].shape[1]), feeds["position_ids"].shape) + 5
        out["token index for position"] = _torch(module, {**feeds, "position_ids": np.ascontiguousarray(index)})
    if config.sliding_window is not None:
        wider = dataclasses.replace(config, sliding_window=config.sliding_window + 1)
        out["window off by one"] = _torch(build_module(wider, w), feeds)
    if config.softcap is not None:
        out["softcap missing"] = _torch(build_module(dataclasses.replace(config, softcap=None), w), feeds)
    if config.sinks:
        out["sink dropped"] = _torch(build_module(config, {**w, "sinks": np.full_like(w["sinks"], -1e4)}), feeds)
    if config.qk_norm is not None:
        wrong = build_module(config, w)
        wrong.q_norm, wrong.k_norm = _WrongAxisNorm(wrong.q_norm), _WrongAxisNorm(wrong.k_norm)
        out["q/k norm on the wrong axis"] = _torch(wrong, feeds)
    return out


@pytest.mark.parametrize("name", ["all", "rope", "window", "softcap", "sinks", "qk_norm"])
def test_planted_faults_fail(name):
    config = LLM_CONFIGS[name]
    w = init_weights(config, 1)
    feeds = make_inputs(config, 3, 11, seed=7, position_offset=5)
    ref = reference_attention(config, w, **feeds)
    faults = _faulty_y(config, w, feeds)
    assert faults and _compare(config, w, _torch(build_module(config, w), feeds), feeds, ref)
    for what, y in faults.items():
        cmp = _compare(config, w, y, feeds, ref)
        assert not cmp, f"{what} passed: {cmp}"


def test_what_each_lowering_cannot_express_is_refused_by_name():
    """The registry's answer for each lowering (attnx.model.cores.core_for): every reason, by name."""
    c = LLM_CONFIGS["all"]  # head_dim 12: not GroupQueryAttention's (a multiple of 8)
    for attention in ("decomposed", "onnx"):
        core_for(attention, dataclasses.replace(c, sinks=False))
    for attention in ("ort-fused-packed", "ort-attention"):
        with pytest.raises(UsageError, match=f"--attention {attention} cannot build .* does not express grouped_heads, "
                           "qk_norm, rope, softcap, sliding_window, sinks"):  # fmt: skip
            core_for(attention, c)
    with pytest.raises(UsageError, match=r"Attention \(opset 23\) does not express sinks"):
        core_for("onnx", c)
    with pytest.raises(UsageError, match="GroupQueryAttention needs v_head_dim == head_dim .*a multiple of 8"):
        core_for("ort-fused", dataclasses.replace(c, v_head_dim=8))
    assert core_for("ort-fused", dataclasses.replace(c, head_dim=16, v_head_dim=16)).name == "gqa"  # grouped heads
    core_for("decomposed", c, "int8")  # every term composes with the quantized error model
    core_for("decomposed", LLM_CONFIGS["rope_llama3"], "int4")  # rope (and qk_norm) compose with it
    for attention in ("decomposed", "onnx"):  # the full-sequence graphs, their angle float32
        core_for(attention, LLM_CONFIGS["rope_llama3"], "fp16")
    core_for("ort-fused", dataclasses.replace(LLM_CONFIGS["rope_llama3"], head_dim=16, v_head_dim=16), "fp16")
    core_for("decomposed", dataclasses.replace(LLM_CONFIGS["rope_llama3"], causal=True, kv_cache=True), "fp16")
    with pytest.raises(UsageError, match="MatMul, Softmax, MatMul is not built in bf16"):
        core_for("decomposed", dataclasses.replace(LLM_CONFIGS["rope_llama3"], causal=True, kv_cache=True), "bf16")
    step = dataclasses.replace(c, kv_cache=True, head_dim=16, v_head_dim=16)
    for attention in ("decomposed", "ort-fused"):
        core_for(attention, step)
    with pytest.raises(UsageError, match="does not express sinks"):
        core_for("onnx", step)
