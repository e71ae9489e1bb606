"""Graph passes: the ort-fused lowering over every config in the registry, from both exported
forms, its variants (packed q/k/v, com.microsoft Attention), auto, and what they report."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from attnx.export import export_onnx, save_model
from attnx.export.passes import FuseAttentionToMHA, count_ops, lowering_of, qk_weights, run_pipeline, v_weights
from attnx.model import AttentionConfig, reference_attention
from attnx.model.contract import IR_VERSION, LOWERINGS, PASS_LOWERINGS
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes import ModelSource
from attnx.runtimes.compare import compare_arrays
from attnx.runtimes.parity import run_parity
from attnx.workflows import AUTO_CANDIDATES, lower
from tests.conftest import CONFIGS, weights_for

MHA = "com.microsoft.MultiHeadAttention"
# (batch, seq, mem_seq): seq 1, lengths the export (batch 2, seq 5, mem_seq 6) never saw, and
# batch 3, whose element 1 has every key hidden by make_inputs' key padding mask.
SHAPES = [(1, 1, 1), (3, 7, 9), (2, 33, 4)]


def _ops(path) -> dict[str, int]:
    return count_ops(ir.load(str(path)))


def _agrees_with_reference(path, config: AttentionConfig, weights, dtype: str = "fp32", shapes=SHAPES) -> None:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch, seq, mem in shapes:
        feeds = make_inputs(config, batch, seq, mem if config.cross else None, dtype=dtype, seed=seq)
        (y,) = session.run(["y"], feeds)
        ref = reference_attention(config, weights, **feeds)
        cmp = compare_arrays("y", y, ref, tolerance_for(dtype, "ort-cpu"), problem_size(config, weights, feeds))
        assert cmp, f"batch={batch} seq={seq}: {cmp}"


def _lowered(exported, tmp_path, name: str, attention: str, *, form: str = "decomposed", weights=None, **kw):
    """`name` exported in `form` (the shared cached export, or one with `weights`), lowered
    in memory and saved; (path, LoweringResult)."""
    config = CONFIGS[name]
    model = ir.load(exported(name, form)) if weights is None else export_onnx(config, weights, attention=form)
    result = lower(model, config, attention=attention, **kw)
    path = tmp_path / f"{name}-{form}-{attention}.onnx"
    save_model(result.model, path)
    return path, result


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ort_fused_export_is_one_multihead_attention(exported, name):
    path = exported(name, "ort-fused")
    proto = onnx.load(path)
    assert proto.ir_version == IR_VERSION
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["attnx.attention"] == "ort-fused"
    ops = _ops(path)
    assert ops.get(MHA) == 1, ops
    # Nothing of the decomposed core is left: no Softmax, no score MatMuls, no [S, L] mask grid.
    assert "Softmax" not in ops and "Attention" not in ops and "Range" not in ops
    assert ops.get("MatMul") == 4  # the q, k, v and output projections only


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ort_fused_export_agrees_with_reference(exported, name):
    config = CONFIGS[name]
    source = ModelSource(config, weights_for(name), exported(name, "ort-fused"))
    report = run_parity(source, ["ort-cpu"], batches=[1, 3], seqs=[1, 7, 40], mem_seqs=[1, 9])
    assert report.passed, [c.reason for c in report.cases if c.status != "pass"]
    assert {c.status for c in report.cases} == {"pass"}


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c.key_padding_mask])
def test_fully_hidden_query_gives_the_output_bias(exported, name):
    """make_inputs hides every key of batch element 1: z = 0 there, so y = out bias (never
    NaN, never the mean of v that the fused op alone would give)."""
    config, weights = CONFIGS[name], weights_for(name)
    session = ort.InferenceSession(exported(name, "ort-fused"), providers=["CPUExecutionProvider"])
    feeds = make_inputs(config, 3, 6, 5 if config.cross else None, seed=2)
    assert feeds["key_padding_mask"][1].all() and not feeds["key_padding_mask"][0].all()
    (y,) = session.run(["y"], feeds)
    assert np.isfinite(y).all()
    expected = weights["out_proj.bias"] if config.bias else np.zeros(config.d_model, np.float32)
    np.testing.assert_allclose(y[1], np.broadcast_to(expected, y[1].shape), rtol=0, atol=1e-6)
    assert np.abs(y[0] - expected).max() > 1e-3  # the other rows are not zeroed


@pytest.mark.parametrize("name", list(CONFIGS))
def test_opset23_attention_node_is_fused(exported, tmp_path, name):
    path, result = _lowered(exported, tmp_path, name, "ort-fused", form="onnx")
    assert result.lowering == "ort-fused"
    assert any("fused onnx attention core" in line for line in result.lines())
    ops = _ops(path)
    assert ops.get(MHA) == 1 and "Attention" not in ops, ops
    _agrees_with_reference(path, CONFIGS[name], weights_for(name))


def test_large_scores_keep_hidden_keys_hidden(exported, tmp_path):
    """Weights scaled up give scores past 1e5: a mask applied as -10000 (the fused op's
    default) would leave hidden keys weight; the pass sets the dtype's lowest value."""
    name = "causal_kpm"
    weights = {k: v * (400.0 if k.startswith(("q_", "k_")) else 1.0) for k, v in weights_for(name).items()}
    path, result = _lowered(exported, tmp_path, name, "ort-fused", weights=weights)
    assert result.lowering == "ort-fused"
    feeds = make_inputs(CONFIGS[name], 2, 40, seed=3)
    assert problem_size(CONFIGS[name], weights, feeds).score_max > 1e5
    _agrees_with_reference(path, CONFIGS[name], weights, shapes=[(3, 40, 1), (1, 9, 1)])


def test_a_mask_it_cannot_read_is_reported_and_left_unfused(exported, tmp_path):
    """A key padding mask passed through Not(Not(.)) means the same but is not a form the
    rules know: the core stays as exported (still correct) and the report says why."""
    name = "kpm"
    config = CONFIGS[name]
    model = ir.load(exported(name))
    kpm = model.graph.inputs[1]
    (unsqueeze,) = [n for n in kpm.uses() if n.node.op_type == "Unsqueeze"]
    once = ir.node("Not", [kpm])
    twice = ir.node("Not", [once.outputs[0]])
    twice.outputs[0].dtype, twice.outputs[0].shape = kpm.dtype, kpm.shape
    model.graph.insert_before(unsqueeze.node, [once, twice])
    unsqueeze.node.replace_input_with(unsqueeze.idx, twice.outputs[0])
    result = lower(model, config, attention="ort-fused")
    assert result.lowering == "decomposed"
    assert model.metadata_props["attnx.attention"] == "decomposed"
    lines = "\n".join(result.lines())
    assert "requested ort-fused" in lines
    assert "not fused" in lines and "neither a causal nor a key padding mask" in lines
    path = tmp_path / "unfused.onnx"
    save_model(model, path)
    assert MHA not in _ops(path)
    _agrees_with_reference(path, config, weights_for(name))


@pytest.mark.parametrize("lowering, op", [("ort-fused-packed", MHA), ("ort-attention", "com.microsoft.Attention")])
@pytest.mark.parametrize("name", ["self", "causal_kpm"])
def test_packed_self_attention_variants(exported, tmp_path, name, lowering, op):
    path, result = _lowered(exported, tmp_path, name, lowering)
    assert result.lowering == lowering
    ops = _ops(path)
    assert ops.get(op) == 1, ops
    assert ops.get("MatMul") == (2 if lowering == "ort-fused-packed" else 1)  # packed q/k/v (+ output)
    _agrees_with_reference(path, CONFIGS[name], weights_for(name))


def test_packed_variants_do_not_apply_to_cross_attention(exported, tmp_path):
    path, result = _lowered(exported, tmp_path, "cross_kpm", "ort-fused-packed")
    assert result.lowering == "ort-fused"  # what the graph holds, not what was asked
    assert any("not applied" in line and "cross-attention" in line for line in result.lines())
    _agrees_with_reference(path, CONFIGS["cross_kpm"], weights_for("cross_kpm"))


def test_auto_measures_candidates_and_records_its_choice(exported, tmp_path):
    name = "causal_kpm"
    path, result = _lowered(exported, tmp_path, name, "auto", auto_shape=(1, 16, 16))
    auto = json.loads(result.model.metadata_props["attnx.auto"])
    assert auto["provider"] == "cpu" and auto["shape"] == [1, 16, 16]
    assert set(auto["status"]) == {"base (decomposed)", *AUTO_CANDIDATES[1:]}
    timed = {k: t for k, t in auto["times_ms"].items() if t is not None}
    assert all(auto["status"][k] == "pass" for k in timed) and all(t > 0 for t in timed.values())
    best = min(timed, key=timed.__getitem__)
    assert auto["choice"] == ("decomposed" if best.startswith("base") else best)
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert meta["attnx.attention"] == auto["choice"] == lowering_of(ir.load(str(path)))
    assert json.loads(meta["attnx.auto"]) == auto
    _agrees_with_reference(path, CONFIGS[name], weights_for(name))


@pytest.mark.parametrize("name", ["cross_kpm"])
def test_ort_fused_fp16(exported, name):
    path = exported(name, "ort-fused", "fp16")
    assert _ops(path).get(MHA) == 1
    assert onnx.load(path).graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    _agrees_with_reference(path, CONFIGS[name], weights_for(name), dtype="fp16")


def test_pipeline_report_counts_nodes_and_keeps_notes(exported):
    model = ir.load(exported("cross"))
    before = len(model.graph)
    model, report = run_pipeline(model, [FuseAttentionToMHA()])
    (record,) = report.records
    assert record.modified and record.nodes_before == before == report.nodes_before
    assert record.nodes_after == len(model.graph) == report.nodes_after
    assert record.notes == [
        "fused decomposed attention core (no mask, 4 heads, head_dim 8, v_head_dim 6, scale 0.353553) "
        "into com.microsoft.MultiHeadAttention"
    ]
    assert report.fused_ops() == {MHA: 1}
    # A second run finds nothing left to fuse, changes nothing, and says so.
    model, again = run_pipeline(model, [FuseAttentionToMHA()])
    assert not again.modified and again.records[0].notes == []


@pytest.mark.parametrize("form", ["decomposed", "onnx"])
def test_qk_weights_reads_the_projections_back(exported, form):
    name = "cross_kpm"
    config, weights = CONFIGS[name], weights_for(name)
    model = ir.load(exported(name, form))
    for stage in ("exported", "fused"):
        found = qk_weights(model)
        assert found is not None, stage
        for key in ("q_proj.weight", "k_proj.weight"):
            np.testing.assert_array_equal(found[key], weights[key])
        np.testing.assert_array_equal(found["q_proj.bias"], 0)  # bias=False in this config
        model = lower(model, config, attention="ort-fused").model


def test_lower_refuses_what_it_cannot_do(exported):
    from attnx.errors import UsageError

    config = CONFIGS["self"]
    model = ir.load(exported("self"))
    with pytest.raises(UsageError, match="written by the exporter at opset 23"):
        lower(model, config, attention="onnx")
    with pytest.raises(UsageError, match="unknown --attention 'flash'"):
        lower(model, config, attention="flash")
    with pytest.raises(UsageError, match="dtype bf16: no attnx graph computes in bfloat16"):
        lower(model, config, attention="ort-fused", dtype="bf16")
    model = lower(model, config, attention="ort-fused").model
    with pytest.raises(UsageError, match="is ort-fused already: no pass turns it back"):
        lower(model, config, attention="decomposed")


def test_weights_made_outside_attnx(tmp_path):
    """torch.nn.MultiheadAttention's own initialisation (not attnx's seeded weights), cross
    attention with a key padding mask, kv width != d_model, through the CLI's export."""
    import torch

    from attnx.cli import main
    from attnx.model import from_torch_mha_state_dict, save_weights

    config = AttentionConfig(d_model=48, n_heads=6, cross=True, kv_dim=40, key_padding_mask=True)
    torch.manual_seed(7)
    mha = torch.nn.MultiheadAttention(48, 6, kdim=40, vdim=40, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_()  # torch initialises biases to 0; a real model's are not
        mha.out_proj.bias.normal_()
    weights = from_torch_mha_state_dict(mha.state_dict(), config)
    (tmp_path / "c.json").write_text(config.to_json())
    save_weights(weights, tmp_path / "w.safetensors")
    out = tmp_path / "m.onnx"
    args = ["export", "--config", str(tmp_path / "c.json"), "--weights", str(tmp_path / "w.safetensors")]
    assert main([*args, "--attention", "ort-fused", "--out", str(out)]) == 0
    assert _ops(out).get(MHA) == 1
    _agrees_with_reference(out, config, weights)
    # and torch's own module agrees too (its key_padding_mask: True hides, as ours)
    feeds = make_inputs(config, 3, 11, 7, seed=5)
    (y,) = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(["y"], feeds)
    with torch.no_grad():
        t, _ = mha(*(torch.from_numpy(feeds[k]) for k in ("x", "memory", "memory")),
                   key_padding_mask=torch.from_numpy(feeds["key_padding_mask"]))  # fmt: skip
    rows = [0, 2]  # torch gives NaN for the fully hidden element 1; attnx gives the out bias
    np.testing.assert_allclose(y[rows], t.numpy()[rows], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "attention"),
    [("self", a) for a in LOWERINGS] + [("cross", "ort-fused"), ("causal_kpm", "ort-fused-packed")],
)
def test_projections_read_back_from_every_lowering(exported, name, attention):
    """`attnx optimize` sizes its tolerance from the model file alone: the q, k and v projections
    (weights and biases, in torch's convention) are read back from every form attnx writes, packed
    ones included (a Split of one MatMul, the op's packed bias, com.microsoft Attention's one weight)."""
    config, weights = CONFIGS[name], weights_for(name)
    form = "onnx" if attention == "onnx" else "decomposed"
    model = ir.load(exported(name, form))
    if attention in PASS_LOWERINGS:
        model = lower(model, config, attention=attention).model
    assert lowering_of(model) == attention
    found = qk_weights(model)
    assert found is not None
    found.update(v_weights(model) or {})
    assert set(found) == {f"{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias")}
    for key, value in found.items():
        np.testing.assert_array_equal(value, weights[key], err_msg=key)
