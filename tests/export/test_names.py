"""The names of every form attnx writes (docs/reference/onnx-graph.md, "Names"): each stage of the formula a graph holds is
a tensor named after it, listed in the metadata with its layout, and holds exactly the reference's
value; weights, constants, nodes and intermediates are named after the formula's terms, never the
exporter's val_5 or linear_1."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attnx.export import build_model, build_step_model, export_onnx
from attnx.export.passes import convert_precision
from attnx.model import AttentionConfig, init_weights, reference_attention
from attnx.model.config import preset
from attnx.model.contract import IR_VERSION
from attnx.model.inputs import make_inputs
from attnx.model.stages import STAGES_KEY, stage_layouts, stages_of, to_canonical
from tests.conftest import CONFIGS, LLM_CONFIGS, LLM_FUSED_CONFIGS

GROUPED = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, causal=True, key_padding_mask=True)
STEP = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, key_padding_mask=True, kv_cache=True,
                       qk_norm={"eps": 1e-5}, rope={"theta": 1000.0, "dim": 8})  # fmt: skip
STEP_MHA = AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True, kv_cache=True)
STEP_INT = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True)
BUFFER = LLM_FUSED_CONFIGS["buffer"]
NOBIAS = AttentionConfig(d_model=32, n_heads=4, causal=True, bias=False)
ALIBI = AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True, alibi=True)  # a bias on the scores
CORE = {"scores", "probs"}
PROJ = {"q", "k", "v"}
# What each form holds, beyond y (and the cache of a step model). The decomposed forms of a config
# with rope and qk_norm hold the norm's output only per head [batch, seq, heads, dim]: a layout no
# stage takes (model.stages.LAYOUTS), so it is not named.
FULL = [  # (label, config, lowering, dtype): the torch export (decomposed) or the registry's emitter
    ("tiny", preset("tiny"), "decomposed", "fp32"),
    ("tiny", preset("tiny"), "onnx", "fp32"),
    ("tiny", preset("tiny"), "ort-fused", "fp32"),
    ("tiny", preset("tiny"), "ort-fused-packed", "fp32"),
    ("tiny", preset("tiny"), "ort-attention", "fp32"),
    ("causal_kpm", CONFIGS["causal_kpm"], "decomposed", "fp32"),
    ("causal_kpm", CONFIGS["causal_kpm"], "ort-fused", "fp32"),
    ("grouped", GROUPED, "decomposed", "fp32"),
    ("grouped", GROUPED, "onnx", "fp32"),
    ("cross", CONFIGS["cross"], "decomposed", "fp32"),
    ("cross", CONFIGS["cross"], "onnx", "fp32"),
    ("cross_kpm", CONFIGS["cross_kpm"], "ort-fused", "fp32"),  # no biases: the op's inputs are q, k, v
    ("nobias", NOBIAS, "ort-fused-packed", "fp32"),
    ("llm", LLM_CONFIGS["llm"], "decomposed", "fp32"),
    ("llama", LLM_CONFIGS["llama"], "decomposed", "fp32"),
    ("alibi", ALIBI, "decomposed", "fp32"),
    ("llm-built", LLM_FUSED_CONFIGS["ort-fused"], "ort-fused", "fp32"),
    ("llm-built", LLM_FUSED_CONFIGS["onnx"], "onnx", "fp32"),
    ("tiny", preset("tiny"), "decomposed", "fp16"),
    ("tiny", preset("tiny"), "ort-fused", "fp16"),
    ("tiny", preset("tiny"), "decomposed", "int8"),
    ("tiny", preset("tiny"), "ort-fused", "int4"),
    ("causal_kpm", CONFIGS["causal_kpm"], "ort-fused-packed", "int8"),
]
STEPS = [  # (config, lowering, form, dtype)
    (STEP, "decomposed", "growing", "fp32"),
    (STEP, "onnx", "growing", "fp32"),
    (STEP, "ort-fused", "growing", "fp32"),
    (STEP_MHA, "ort-fused", "growing", "fp32"),  # MultiHeadAttention
    (BUFFER, "ort-fused", "buffer", "fp32"),
    (STEP_INT, "ort-fused", "buffer", "int8"),
    (STEP_INT, "decomposed", "growing", "int4"),
]


def expected_stages(config: AttentionConfig, lowering: str, form: str = "full") -> set[str]:
    c = config
    every = {s.name for s in stages_of(c, step=form != "full")}
    if lowering == "decomposed":
        return every
    if form == "buffer":  # the op rotates: q/k apart only when the norms split them
        return every - CORE - {"q_rope", "k_rope"} - (set() if c.qk_norm is not None else PROJ | {"q_norm", "k_norm"})
    if c.llm_keys or form != "full" or lowering == "onnx":  # GroupQueryAttention, a step model, Attention-23
        return every - CORE
    if lowering == "ort-attention":  # the packed weights are the op's input
        return every - CORE - PROJ
    return every - CORE - (PROJ if c.bias else set())  # MultiHeadAttention folds the biases in


def _full_model(config, lowering, dtype, weights) -> onnx.ModelProto:
    """The decomposed form as `attnx export` writes it (the torch export, its precision by the passes);
    every other lowering written from the registry."""
    if lowering != "decomposed":
        return build_model(config, weights, lowering, "full", dtype)
    model = export_onnx(config, weights)
    if dtype != "fp32":
        model = convert_precision(model, dtype).model
    return ir.to_proto(model)


def _step_feeds(c: AttentionConfig, form: str, past: int = 3, seq: int = 1, batch: int = 2):
    """(feeds of the model, the reference's arguments) of a decode step (GroupQueryAttention takes one token a
    row after a past)."""
    rng = np.random.default_rng(7)
    total = past + seq
    base = make_inputs(dataclasses.replace(c, kv_cache=False), batch, total, seed=3)
    shape = (batch, c.n_kv_heads, past, c.head_dim)
    pk, pv = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    ref = {"x": base["x"][:, past:], "past_key": pk, "past_value": pv}
    if c.key_padding_mask:
        ref["key_padding_mask"] = base["key_padding_mask"]
    if c.rope is not None:
        ref["position_ids"] = (base["position_ids"][:, past:] if form == "growing"
                               else np.tile(np.arange(past, total, dtype=np.int64), (batch, 1)))  # fmt: skip
    if form == "growing":
        return dict(ref), ref
    capacity = total + 2
    bk, bv = (np.zeros((batch, c.n_kv_heads, capacity, c.head_dim), np.float32) for _ in range(2))
    bk[:, :, :past], bv[:, :, :past] = pk, pv
    feeds = {"x": ref["x"], "past_key": bk, "past_value": bv, "seqlens_k": np.full(batch, total - 1, np.int32),
             "total_sequence_length": np.array(total, np.int32)}  # fmt: skip
    return feeds, ref


def check_names(model: onnx.ModelProto, config: AttentionConfig, weights, feeds, ref_args, expected: set[str],
                dtype: str = "fp32") -> None:  # fmt: skip
    """(1) the metadata lists `expected`, (2) each listed stage is a tensor, (3) each holds the
    reference's value (shape only for fp16/int8/int4), (4) no exporter name is left, and the model
    passes the checker and loads in ONNX Runtime."""
    layouts = stage_layouts({p.key: p.value for p in model.metadata_props})
    assert expected <= set(layouts), f"missing stages {sorted(expected - set(layouts))} in {layouts}"
    produced = {o for n in model.graph.node for o in n.output} | {o.name for o in model.graph.output}
    assert set(layouts) <= produced, f"stages without a tensor: {sorted(set(layouts) - produced)}"
    bad = re.compile(r"^(val_\d|node_|(linear|mul|add|view|transpose|matmul|_unsafe_view|_to_copy|where|cat|slice|"
                     r"softmax|masked_fill|repeat_interleave|arange|zeros)(_\d+)?$)")  # fmt: skip
    names = [i.name for i in model.graph.initializer] + [n.name for n in model.graph.node]
    names += [o for n in model.graph.node for o in n.output]
    assert not [n for n in names if bad.match(n)], [n for n in names if bad.match(n)][:5]
    assert len({n.name for n in model.graph.node}) == len(model.graph.node), "node names are not unique"
    assert model.ir_version == IR_VERSION
    onnx.checker.check_model(model)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    outputs = {o.name for o in probe.graph.output}
    elem = TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.FLOAT
    for stage in layouts:
        if stage not in outputs:
            probe.graph.output.append(helper.make_tensor_value_info(stage, elem, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    if dtype == "fp16":
        feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    got = dict(zip(list(layouts), session.run(list(layouts), feeds)))
    d: dict[str, np.ndarray] = {}
    reference_attention(config, weights, **ref_args, stages=d)
    for stage, layout in layouts.items():
        value = to_canonical(stage, np.asarray(got[stage], np.float64), layout, config)
        want = d[stage]
        if stage.startswith("present_") and value.shape[2] > want.shape[2]:  # the buffer form's capacity
            value = value[:, :, : want.shape[2]]
        assert value.shape == want.shape, f"{stage}: shape {value.shape}, reference {want.shape}"
        if dtype != "fp32":
            continue
        if stage == "probs":
            value, want = value[d["probs_rows"]], want[d["probs_rows"]]
        atol = 1e-4 * max(float(np.abs(want).max()), 1e-30)
        np.testing.assert_allclose(value, want, rtol=1e-4, atol=atol, err_msg=f"stage {stage} ({layout})")


@pytest.mark.parametrize(("label", "config", "lowering", "dtype"), FULL,
                         ids=[f"{f[0]}-{f[2]}-{f[3]}" for f in FULL])  # fmt: skip
def test_full_sequence_forms_name_their_stages(label, config, lowering, dtype):
    # the weights `attnx export --preset tiny` draws (seed 0), and the registry's elsewhere (seed 1, as
    # tests.conftest.weights_for): a torch export is keyed by its weights, so these reuse the suite's traces
    weights = init_weights(config, 0 if label == "tiny" else 1)
    model = _full_model(config, lowering, dtype, weights)
    feeds = make_inputs(config, 2, 5, 4 if config.cross else None, seed=11)
    expected = expected_stages(config, lowering)
    check_names(model, config, weights, feeds, feeds, expected, dtype)
    inits = {i.name for i in model.graph.initializer}
    if dtype == "fp32" and lowering not in ("ort-fused-packed", "ort-attention"):
        assert {"q_proj.weight.T", "out_proj.weight.T"} <= inits
    if dtype in ("int8", "int4"):
        assert {"out_proj.weight.quant", "out_proj.weight.scale", "out_proj.weight.zero_point"} <= inits
    if lowering in ("ort-fused-packed", "ort-attention") and dtype == "fp32":
        assert "qkv_proj.weight.T" in inits and ("qkv_proj.bias" in inits) == config.bias
    if lowering == "decomposed" and dtype == "fp32":
        assert "scale" in inits and {"scores/Mul", "probs/Softmax", "q_proj/MatMul"} <= {n.name for n in model.graph.node}


@pytest.mark.parametrize(("config", "lowering", "form", "dtype"), STEPS,
                         ids=[f"{s[1]}-{s[2]}-{s[3]}-{s[0].n_kv_heads}kv" for s in STEPS])  # fmt: skip
def test_step_models_name_their_stages(config, lowering, form, dtype):
    weights = init_weights(config, 2)
    model = build_step_model(config, weights, lowering, form, dtype)
    feeds, ref_args = _step_feeds(config, form)
    check_names(model, config, weights, feeds, ref_args, expected_stages(config, lowering, form), dtype)
    inits = {i.name for i in model.graph.initializer}
    proj = "qkv_proj" if form == "buffer" else "q_proj"
    assert (f"{proj}.weight.T" if dtype == "fp32" else f"{proj}.weight.quant") in inits
    assert "weight_t" not in " ".join(inits)


def test_names_survive_a_second_naming():
    """NameStages runs again after every lowering: on a named graph it changes nothing."""
    config = CONFIGS["causal_kpm"]
    model = export_onnx(config, init_weights(config, 1))
    before = ir.to_proto(model)
    from attnx.export.passes._names import NameStages

    NameStages()(model)
    after = ir.to_proto(model)
    assert [n.name for n in before.graph.node] == [n.name for n in after.graph.node]
    assert [list(n.output) for n in before.graph.node] == [list(n.output) for n in after.graph.node]
    assert json.loads({p.key: p.value for p in after.metadata_props}[STAGES_KEY])["scores"] == "b h t s"
