"""The mask reader of the fused lowering (export/passes/_masks.py): the forms the exporter writes
are recognised, and every other form is refused with its reason (NotRead), never guessed at.

Each graph here is a small boolean subgraph built by hand: `hidden` (True hides) over queries of
length S and keys of length L, the symbols of the exporter's dynamic axes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from attnx.export.passes import KeyMask, NotRead
from attnx.export.passes._masks import classify_any_visible, classify_attend, classify_hidden, const_array
from attnx.model.contract import IR_VERSION

S, L = ir.SymbolicDim("S"), ir.SymbolicDim("L")


def _graph(nodes, inputs, outputs, inits=()) -> dict[str, ir.Value]:
    """The values of a hand-built graph by name, shapes inferred; the Range's length annotated S, as
    the exporter annotates it (its dynamic axis, the query length)."""
    graph = helper.make_graph(nodes, "mask", inputs, outputs, list(inits),
                              value_info=[helper.make_tensor_value_info("r", TensorProto.INT64, ["S"])])  # fmt: skip
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto, data_prop=True))
    values = {v.name: v for v in model.graph.inputs}
    for node in model.graph:
        values.update({v.name: v for v in node.outputs})
    return values


def _ints(name: str, values) -> onnx.TensorProto:
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def _causal_nodes(op="Greater", start=0, step=1, col_axes=(0,), row_axes=(1,), grid_axes=(0, 1)):
    """hidden = Unsqueeze(op(Unsqueeze(r, col_axes), Unsqueeze(r, row_axes)), grid_axes), r = Range(start, S, step)
    with S the query length (Shape of x, axis 1): the exporter's causal mask when op is Greater."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["n"], axis=0),
        helper.make_node("Range", ["start", "n", "step"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "col_axes"], ["cols"]),
        helper.make_node("Unsqueeze", ["r", "row_axes"], ["rows"]),
        helper.make_node(op, ["cols", "rows"] if op == "Greater" else ["rows", "cols"], ["grid"]),
        helper.make_node("Unsqueeze", ["grid", "grid_axes"], ["hidden"]),
    ]
    inits = [
        helper.make_tensor("one", TensorProto.INT64, [], [1]),
        helper.make_tensor("start", TensorProto.INT64, [], [start]),
        helper.make_tensor("step", TensorProto.INT64, [], [step]),
        _ints("col_axes", list(col_axes)),
        _ints("row_axes", list(row_axes)),
        _ints("grid_axes", list(grid_axes)),
    ]
    return nodes, inits


X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 8])
KPM = helper.make_tensor_value_info("kpm", TensorProto.BOOL, ["B", "L"])
HIDDEN = helper.make_tensor_value_info("hidden", TensorProto.BOOL, None)


def _causal(**kw) -> dict[str, ir.Value]:
    nodes, inits = _causal_nodes(**kw)
    return _graph(nodes, [X], [HIDDEN], inits)


def _padding(kpm=KPM, axes=(1, 2)) -> dict[str, ir.Value]:
    node = helper.make_node("Unsqueeze", [kpm.name, "axes"], ["hidden"])
    return _graph([node], [kpm], [HIDDEN], [_ints("axes", list(axes))])


def test_the_exporters_forms_are_read():
    assert classify_hidden(_causal()["hidden"], S, S) == KeyMask(causal=True)
    assert classify_hidden(_causal(op="Less")["hidden"], S, S) == KeyMask(causal=True)  # Less(i, j) = Greater(j, i)
    v = _padding()
    assert classify_hidden(v["hidden"], S, L) == KeyMask(key_padding=v["kpm"])
    assert KeyMask(key_padding=v["kpm"]).describe() == "key padding mask 'kpm'"
    assert KeyMask().empty and KeyMask().describe() == "no mask"


def test_causal_and_padding_combined_by_or():
    nodes, inits = _causal_nodes()
    nodes = [*nodes[:-1], helper.make_node("Unsqueeze", ["grid", "grid_axes"], ["causal"]),
             helper.make_node("Unsqueeze", ["kpm", "kpm_axes"], ["padding"]),
             helper.make_node("Or", ["causal", "padding"], ["hidden"])]  # fmt: skip
    self_kpm = helper.make_tensor_value_info("kpm", TensorProto.BOOL, ["B", "S"])  # self-attention: keys = queries
    v = _graph(nodes, [X, self_kpm], [HIDDEN], [*inits, _ints("kpm_axes", [1, 2])])
    mask = classify_hidden(v["hidden"], S, S)
    assert mask == KeyMask(causal=True, key_padding=v["kpm"])
    assert mask.describe() == "causal + key padding mask 'kpm'"


@pytest.mark.parametrize(
    ("variant", "q_len", "kv_len"),
    [
        ({"start": 1}, S, S),  # Range(1, S): the grid is shifted by one
        ({"step": 2}, S, S),
        ({"col_axes": (1,), "row_axes": (0,)}, S, S),  # i along the last axis: the transposed mask (j < i)
        ({"grid_axes": (0, 2)}, S, S),
        ({"op": "GreaterOrEqual"}, S, S),  # j >= i hides the diagonal too
        ({}, S, L),  # a causal grid for keys of another length (cross-attention) means nothing
        ({}, L, L),  # a Range over a length that is not the query's
    ],
)
def test_a_grid_that_is_not_the_causal_one_is_refused(variant, q_len, kv_len):
    if variant.get("op") == "GreaterOrEqual":
        nodes, inits = _causal_nodes()
        nodes[5] = helper.make_node("GreaterOrEqual", ["cols", "rows"], ["grid"])
        v = _graph(nodes, [X], [HIDDEN], inits)
    else:
        v = _causal(**variant)
    with pytest.raises(NotRead, match="neither a causal nor a key padding mask"):
        classify_hidden(v["hidden"], q_len, kv_len)


def test_a_key_padding_input_that_does_not_fit_is_refused():
    with pytest.raises(NotRead, match="'kpm' is not a boolean \\[batch, keys\\] key padding mask"):
        classify_hidden(_padding(helper.make_tensor_value_info("kpm", TensorProto.BOOL, ["B", "S", "L"]))["hidden"],
                        S, L)  # fmt: skip
    with pytest.raises(NotRead, match="key padding mask 'kpm' has L keys, the attention S"):
        classify_hidden(_padding()["hidden"], S, S)
    with pytest.raises(NotRead, match="neither a causal nor a key padding mask"):
        classify_hidden(_padding(axes=(1,))["hidden"], S, L)  # [B, 1, L]: not one flag per key for every query


def test_masks_of_other_producers_or_types_are_refused():
    v = _graph([helper.make_node("Not", ["kpm"], ["hidden"])], [KPM], [HIDDEN])
    with pytest.raises(NotRead, match="built by Not \\('hidden'\\), neither a causal nor a key padding mask"):
        classify_hidden(v["hidden"], S, L)
    v = _graph([], [helper.make_tensor_value_info("hidden", TensorProto.BOOL, ["B", 1, "S", "L"])], [HIDDEN])
    with pytest.raises(NotRead, match="built by graph input 'hidden'"):
        classify_hidden(v["hidden"], S, L)
    v = _graph([helper.make_node("Cast", ["kpm"], ["hidden"], to=TensorProto.FLOAT)], [KPM],
               [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, None)])  # fmt: skip
    with pytest.raises(NotRead, match="'hidden' is FLOAT, not a boolean mask"):
        classify_hidden(v["hidden"], S, L)


def test_two_key_padding_inputs_in_one_mask_are_refused():
    other = helper.make_tensor_value_info("kpm2", TensorProto.BOOL, ["B", "L"])
    nodes = [helper.make_node("Unsqueeze", ["kpm", "axes"], ["a"]), helper.make_node("Unsqueeze", ["kpm2", "axes"], ["b"]),
             helper.make_node("Or", ["a", "b"], ["hidden"])]  # fmt: skip
    v = _graph(nodes, [KPM, other], [HIDDEN], [_ints("axes", [1, 2])])
    with pytest.raises(NotRead, match="two different key padding inputs"):
        classify_hidden(v["hidden"], S, L)


def test_attention_op_mask_is_not_hidden():
    nodes, inits = _causal_nodes()
    attend = [*nodes, helper.make_node("Not", ["hidden"], ["attend"])]
    v = _graph(attend, [X], [helper.make_tensor_value_info("attend", TensorProto.BOOL, None)], inits)
    assert classify_attend(v["attend"], S, S) == KeyMask(causal=True)
    expanded = [*attend, helper.make_node("Expand", ["attend", "to"], ["wide"])]  # repeats values, changes none
    v = _graph(expanded, [X], [helper.make_tensor_value_info("wide", TensorProto.BOOL, None)],
               [*inits, _ints("to", [2, 1, 1, 1])])  # fmt: skip
    assert classify_attend(v["wide"], S, S) == KeyMask(causal=True)
    v = _graph([*nodes, helper.make_node("Identity", ["hidden"], ["attend"])], [X],
               [helper.make_tensor_value_info("attend", TensorProto.BOOL, None)], inits)  # fmt: skip
    with pytest.raises(NotRead, match="built by Identity \\('attend'\\), not Not\\(hidden\\)"):
        classify_attend(v["attend"], S, S)
    additive = [*nodes, helper.make_node("Cast", ["hidden"], ["attend"], to=TensorProto.FLOAT)]
    v = _graph(additive, [X], [helper.make_tensor_value_info("attend", TensorProto.FLOAT, None)], inits)
    with pytest.raises(NotRead, match="is FLOAT, not boolean \\(an additive mask\\)"):
        classify_attend(v["attend"], S, S)


def _visible(axes=(-1,), keepdims=1, to=TensorProto.BOOL) -> dict[str, ir.Value]:
    nodes, inits = _causal_nodes()
    nodes += [
        helper.make_node("Cast", ["hidden"], ["hidden_i"], to=TensorProto.INT32),
        helper.make_node("ReduceMin", ["hidden_i", "reduce_axes"], ["all_i"], keepdims=keepdims),
        helper.make_node("Cast", ["all_i"], ["all_hidden"], to=to),
    ]
    out = "all_hidden"
    if to == TensorProto.BOOL:
        nodes.append(helper.make_node("Not", ["all_hidden"], ["visible"]))
        out = "visible"
    return _graph(
        nodes, [X], [helper.make_tensor_value_info(out, to, None)], [*inits, _ints("reduce_axes", list(axes))]
    )


def test_the_zeroing_condition_is_read_and_its_variants_refused():
    assert classify_any_visible(_visible()["visible"], S, S) == KeyMask(causal=True)
    assert classify_any_visible(_visible(axes=(3,))["visible"], S, S) == KeyMask(causal=True)  # -1 of rank 4
    for kw in ({"axes": (2,)}, {"axes": (2, 3)}, {"keepdims": 0}):
        with pytest.raises(NotRead, match="does not reduce over the keys"):
            classify_any_visible(_visible(**kw)["visible"], S, S)
    with pytest.raises(NotRead, match="is not 'not all keys hidden'"):
        classify_any_visible(_visible(to=TensorProto.FLOAT)["all_hidden"], S, S)  # no Not on top
    with pytest.raises(NotRead, match="is not 'not all keys hidden'"):
        classify_any_visible(_causal()["hidden"], S, S)


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ({"value": helper.make_tensor("t", TensorProto.INT64, [2], [3, 4])}, [3, 4]),
        ({"value_int": 5}, 5),
        ({"value_float": 0.5}, 0.5),
        ({"value_ints": [1, 2]}, [1, 2]),
        ({"value_floats": [0.25]}, [0.25]),
    ],
)
def test_const_array_reads_constants_of_every_attribute(attrs, expected):
    v = _graph([helper.make_node("Constant", [], ["c"], **attrs)], [],
               [helper.make_tensor_value_info("c", TensorProto.UNDEFINED, None)])  # fmt: skip
    np.testing.assert_array_equal(const_array(v["c"]), np.array(expected))
    assert const_array(None) is None
    assert const_array(_padding()["kpm"]) is None  # a graph input is not a constant
