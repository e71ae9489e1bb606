"""The exporter: contract dims, metadata, IR version, external data, agreement with the formula."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from attnx.errors import ExportError, UsageError
from attnx.export import build_model, export_onnx, save_model
from attnx.export._export import name_contract_dims
from attnx.model import AttentionConfig, init_weights, reference_attention, save_weights
from attnx.model.contract import CONFIG_KEY as CONFIG_METADATA_KEY
from attnx.model.contract import IR_VERSION, MAX_OPSET
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays
from attnx.workflows import check_model_file
from tests.conftest import CONFIGS

LOWERINGS = ["decomposed", "onnx"]
# The torch exports below draw the registry's weights (seed 1, as the exported fixture and tests.conftest.weights_for):
# the trace is keyed by the weights, so they reuse the suite's traces of those configs where the weights do not matter.


def _dims(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("attention", LOWERINGS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_follows_the_contract(exported, name, attention):
    config = CONFIGS[name]
    proto = onnx.load(exported(name, attention))
    assert proto.ir_version == IR_VERSION
    assert {p.key: p.value for p in proto.metadata_props}[CONFIG_METADATA_KEY] == config.to_json()
    io = {v.name: _dims(v) for v in [*proto.graph.input, *proto.graph.output]}
    assert io == {s.name: list(s.shape) for s in config.inputs() + config.outputs()}
    ops = [n.op_type for n in proto.graph.node]
    if attention == "onnx":
        assert ops.count("Attention") == 1
    else:
        assert "Attention" not in ops and "Softmax" in ops


@pytest.mark.parametrize("attention", LOWERINGS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_agrees_with_reference_at_new_shapes(exported, name, attention):
    config = CONFIGS[name]
    w = init_weights(config, 1)
    session = ort.InferenceSession(exported(name, attention), providers=["CPUExecutionProvider"])
    for batch, seq, mem in [(1, 1, 1), (3, 7, 9), (4, 40, 2)]:
        feeds = make_inputs(config, batch, seq, mem if config.cross else None, seed=seq)
        (y,) = session.run(["y"], feeds)
        ref = reference_attention(config, w, **feeds)
        cmp = compare_arrays("y", y, ref, tolerance_for("fp32"), problem_size(config, w, feeds))
        assert cmp, f"{name} {attention} batch={batch} seq={seq}: {cmp}"


def test_specialised_dim_is_an_error():
    config = CONFIGS["self"]
    model = export_onnx(config, init_weights(config, 1))
    x = model.graph.inputs[0]
    x.shape = ir.Shape([x.shape[0], 5, 32])  # as if the exporter had specialised seq
    with pytest.raises(ExportError, match="specialised dim 'seq' of 'x'"):
        name_contract_dims(model, config)


def test_exporter_symbol_names_are_renamed_everywhere():
    config = CONFIGS["cross"]
    model = export_onnx(config, init_weights(config, 1))
    # Rename the contract symbols to exporter-style ones, as torch may produce (s77...).
    for value in [*model.graph.inputs, *model.graph.outputs, *(o for n in model.graph for o in n.outputs)]:
        if value.shape is not None:
            value.shape = ir.Shape(
                [ir.SymbolicDim({"batch": "s0", "seq": "s77", "mem_seq": "s12"}.get(d.value, d.value))
                 if isinstance(d, ir.SymbolicDim) else d for d in value.shape]  # fmt: skip
            )
    name_contract_dims(model, config)
    assert [str(d) for d in model.graph.inputs[1].shape] == ["batch", "mem_seq", "24"]
    symbols = {str(d) for n in model.graph for o in n.outputs if o.shape for d in o.shape if isinstance(d, ir.SymbolicDim)}
    assert not symbols & {"s0", "s77", "s12"}


def test_unified_dims_are_an_error():
    config = CONFIGS["cross"]
    model = export_onnx(config, init_weights(config, 1))
    mem = model.graph.inputs[1]
    mem.shape = ir.Shape([mem.shape[0], ir.SymbolicDim("seq"), 24])
    with pytest.raises(ExportError, match="unified dims"):
        name_contract_dims(model, config)


def test_onnx_lowering_needs_opset_23():
    with pytest.raises(UsageError, match=r"--opset 18 is outside what the Attention \(opset 23\) graph of this config "
                       r"is written at \(23 to 25\)"):  # fmt: skip
        build_model(CONFIGS["self"], init_weights(CONFIGS["self"]), "onnx", opset=18)
    with pytest.raises(UsageError, match="is written by attnx.export.build_model"):
        export_onnx(CONFIGS["self"], attention="onnx")  # the exporter traces the decomposed form alone


@pytest.mark.parametrize("attention", ["decomposed", "onnx"])
def test_an_opset_is_honoured_or_refused(attention, tmp_path):
    """Every opset of a lowering's range is written as asked and loads in the pinned onnxruntime;
    one outside is refused (the exporter would silently write 18): the torch export (decomposed) and
    the registry's emitter alike."""
    low = 23 if attention == "onnx" else 18
    config = CONFIGS["kpm"]

    def write(opset):
        if attention == "decomposed":
            return export_onnx(config, init_weights(config, 1), attention=attention, opset=opset)
        return ir.from_proto(build_model(config, init_weights(config), attention, opset=opset))

    for opset in (low, MAX_OPSET):
        path = tmp_path / f"{opset}.onnx"
        save_model(write(opset), path)
        assert onnx.load(path).opset_import[0].version == opset
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for opset in (7, low - 1, MAX_OPSET + 1, 99):
        with pytest.raises(UsageError, match="outside what"):
            write(opset)


def test_external_data_is_one_relative_file(tmp_path):
    config = CONFIGS["self"]
    model = export_onnx(config, init_weights(config, 1))
    path = tmp_path / "m.onnx"
    files = save_model(model, path, external_data=True)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    assert files == [str(path), str(tmp_path / "m.onnx.data")]
    proto = onnx.load(str(path), load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"m.onnx.data"}
    check_model_file(path, config)  # checker by path, dims, ORT load


def test_save_into_missing_folder_is_a_usage_error(tmp_path):
    config = CONFIGS["self"]
    with pytest.raises(UsageError, match="does not exist"):
        save_model(export_onnx(config, init_weights(config, 1)), tmp_path / "nope" / "m.onnx")


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(d_model=24, n_heads=3, head_dim=10, v_head_dim=5, cross=True, kv_dim=17, key_padding_mask=True),
        AttentionConfig(d_model=40, n_heads=5, causal=True, key_padding_mask=True, scale=0.7),
        AttentionConfig(d_model=16, n_heads=1, bias=False),
    ],
)
def test_weights_made_outside_attnx(tmp_path, config):
    """A user's config file and weights from plain torch Linear layers (not attnx's init, and
    far larger than it: randn), through the CLI's path: load, export, run, compare."""
    from attnx.model import load_config, load_weights
    from attnx.workflows import export_model

    torch.manual_seed(5)
    weights = {}
    for name, (out_f, in_f) in {"q_proj": (config.q_dim, config.d_model), "k_proj": (config.q_dim, config.kv_dim),
                                "v_proj": (config.v_dim, config.kv_dim), "out_proj": (config.d_model, config.v_dim)}.items():  # fmt: skip
        weights[f"{name}.weight"] = torch.randn(out_f, in_f).numpy()
        if config.bias:
            weights[f"{name}.bias"] = torch.randn(out_f).numpy()
    (tmp_path / "c.json").write_text(json.dumps({k: v for k, v in config.to_dict().items() if v is not None}))
    save_weights(weights, tmp_path / "w.safetensors")
    loaded_config = load_config(tmp_path / "c.json")
    loaded = load_weights(tmp_path / "w.safetensors", loaded_config)
    export_model(loaded_config, tmp_path / "m.onnx", loaded, validate=True)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for batch, seq, mem in [(2, 11, 4), (1, 300, 31)]:
        feeds = make_inputs(config, batch, seq, mem if config.cross else None, seed=2)
        (y,) = session.run(["y"], feeds)
        ref = reference_attention(config, weights, **feeds)
        assert np.isfinite(y).all()
        cmp = compare_arrays("y", y, ref, tolerance_for("fp32"), problem_size(config, weights, feeds))
        assert cmp, str(cmp)


def test_no_rewrite_rule_keeps_the_exported_graph_alive():
    """onnxscript's module-level rule matchers keep the last graph they matched (and through it
    every weight: 2.4 GB for gpt3); export_onnx releases them (release_rewriter_state)."""
    import gc

    from onnxscript.rewriter._matcher import SimplePatternMatcher

    export_onnx(CONFIGS["self"], init_weights(CONFIGS["self"], 1))
    # by type, as release_rewriter_state finds them: isinstance() wakes torch's deprecated attributes
    types = {SimplePatternMatcher, *SimplePatternMatcher.__subclasses__()}
    matchers = [o for o in gc.get_objects() if type(o) in types]
    assert matchers, "no matcher found: onnxscript's layout changed, release_rewriter_state releases nothing"
    assert all(getattr(m, "_graph", None) is None for m in matchers)


def test_a_trace_kept_in_the_trace_folder_serves_the_next_process(tmp_path, monkeypatch):
    """$ATTNX_TRACE_CACHE: the trace is written there whole (by rename) and read back by a process
    that has none in memory, without tracing; changed sources of attnx (the key's digest) miss."""
    from attnx.export._export import TRACE_CACHE_ENV, TRACES

    monkeypatch.setenv(TRACE_CACHE_ENV, str(tmp_path))
    config = AttentionConfig(d_model=24, n_heads=2, causal=True)  # a config no other test traces
    TRACES.clear()
    first = export_onnx(config, seed=3)
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].endswith(".onnx"), files
    TRACES.clear()  # as a fresh process: nothing in memory

    def no_trace(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(torch.onnx, "export", no_trace)
    again = export_onnx(config, seed=3)
    assert ir.to_proto(again).SerializeToString() == ir.to_proto(first).SerializeToString()
    TRACES.clear()
    monkeypatch.setattr(TRACES, "_sources", "other sources")
    with pytest.raises(ExportError, match="traced again"):
        export_onnx(config, seed=3)


def test_a_second_export_of_the_same_model_is_a_fresh_copy_of_the_first():
    """export_onnx keeps this process's traces (TRACES): the same config, weights, lowering and
    opset give a copy (a pass that changes it changes nothing of the next), anything else traces."""
    from attnx.export._export import TRACES

    config = CONFIGS["causal"]
    weights = init_weights(config, 1)
    first = export_onnx(config, weights)
    first.graph.remove(list(first.graph)[-1], safe=False)  # as a pass working in place would
    second = export_onnx(config, weights)
    assert len(second.graph) == len(first.graph) + 1
    assert TRACES.key(config, weights, 0, "decomposed", 18) == TRACES.key(config, dict(weights), 0, "decomposed", 18)
    other = {**weights, "q_proj.bias": weights["q_proj.bias"] + 1}
    assert TRACES.key(config, other, 0, "decomposed", 18) != TRACES.key(config, weights, 0, "decomposed", 18)
    assert TRACES.key(config, None, 1, "decomposed", 18) != TRACES.key(config, None, 2, "decomposed", 18)
    assert TRACES.key(config, weights, 0, "onnx", 23) != TRACES.key(config, weights, 0, "decomposed", 18)
    feeds = make_inputs(config, 1, 3)
    y = ort.InferenceSession(ir.to_proto(export_onnx(config, other)).SerializeToString(),
                             providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    ref = reference_attention(config, other, feeds["x"])
    cmp = compare_arrays("y", y, ref, tolerance_for("fp32"), problem_size(config, other, feeds))
    assert cmp, cmp  # the other weights' own trace, not the first's
