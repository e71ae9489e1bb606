"""The pass that makes a repeated computation once (attnx.export.passes.share) on small hand-built graphs: two blocks'
tables over the same input and equal constants become one and the graph computes exactly what it did; what differs
(a constant's value, an input, an attribute), what the graph outputs and what lies outside the prefix is left."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from attnx.export.passes.share import ShareRepeated
from attnx.model.contract import IR_VERSION

RNG = np.random.default_rng(0)
FREQ = RNG.standard_normal(4).astype(np.float32)


def _table(prefix: str, freq: np.ndarray, name: str | None = None, perm: bool = False) -> tuple[list, dict]:
    """cos(positions * freq) as a block writes it under `prefix`, its constant its own copy; `name`: its last node's
    output (a graph output), perm: an attribute of another value."""
    out = name or f"{prefix}cos"
    nodes = [helper.make_node("Cast", ["positions"], [f"{prefix}cast"], name=f"{prefix}Cast", to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", [f"{prefix}cast", f"{prefix}axes"], [f"{prefix}u"], name=f"{prefix}Unsq"),
             helper.make_node("Mul", [f"{prefix}u", f"{prefix}freq"], [f"{prefix}m"], name=f"{prefix}Mul"),
             helper.make_node("Transpose", [f"{prefix}m"], [f"{prefix}t"], name=f"{prefix}T",
                              perm=[1, 0, 2] if perm else [0, 1, 2]),
             helper.make_node("Cos", [f"{prefix}t"], [out], name=f"{prefix}Cos")]  # fmt: skip
    return nodes, {f"{prefix}axes": np.asarray([-1], np.int64), f"{prefix}freq": freq}


def _model(blocks: list[tuple[list, dict]], outputs: list[str]) -> ir.Model:
    nodes = [n for b, _ in blocks for n in b]
    inits = {k: v for _, i in blocks for k, v in i.items()}
    nodes += [helper.make_node("Add", [a, b], [f"sum{i}"]) for i, (a, b) in enumerate(zip(outputs, outputs[1:]))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("positions", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                               for o in [f"sum{i}" for i in range(len(outputs) - 1)] or outputs],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = IR_VERSION
    return ir.from_proto(model)


def _run(model: ir.Model, positions: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"positions": positions})


POSITIONS = np.arange(6, dtype=np.int64).reshape(2, 3)


def test_two_blocks_tables_over_equal_constants_are_computed_once_and_the_same():
    blocks = [_table("attnx/block0/", FREQ), _table("attnx/block1/", FREQ.copy())]
    before = _run(_model(blocks, ["attnx/block0/cos", "attnx/block1/cos"]), POSITIONS)
    model = _model(blocks, ["attnx/block0/cos", "attnx/block1/cos"])
    share = ShareRepeated(prefix="attnx/")
    assert share(model).modified and share.notes == ["5 node(s) repeating another's computation read its outputs "
                                                     "instead"]  # fmt: skip
    assert [n.op_type for n in model.graph] == ["Cast", "Unsqueeze", "Mul", "Transpose", "Cos", "Add"]
    add = list(model.graph)[-1]
    assert add.inputs[0] is add.inputs[1]  # both blocks read the one table
    after = _run(model, POSITIONS)
    assert np.array_equal(after[0], before[0])  # the same operations on the same values: bit for bit


def test_what_differs_is_left_as_it_is():
    other = FREQ + np.float32(1)
    cases = {"another constant": [_table("attnx/block0/", FREQ), _table("attnx/block1/", other)],
             "another attribute": [_table("attnx/block0/", FREQ), _table("attnx/block1/", FREQ, perm=True)]}
    for what, blocks in cases.items():
        model = _model(blocks, ["attnx/block0/cos", "attnx/block1/cos"])
        ShareRepeated(prefix="attnx/")(model)
        ops = [n.op_type for n in model.graph]
        # the Cast and Unsqueeze read the same input and equal constants either way; what follows differs
        assert ops.count("Mul" if what == "another constant" else "Transpose") == 2, (what, ops)
        assert ops.count("Cos") == 2, (what, ops)


def test_graph_outputs_and_nodes_outside_the_prefix_are_kept():
    outputs = ["attnx/block0/cos", "attnx/block1/cos"]
    graph_outputs = _model([_table("attnx/block0/", FREQ), _table("attnx/block1/", FREQ)], outputs)
    graph_outputs.graph.outputs[:] = [v for n in graph_outputs.graph for v in n.outputs if v.name in outputs]
    ShareRepeated(prefix="attnx/")(graph_outputs)
    assert [n.op_type for n in graph_outputs.graph].count("Cos") == 2  # each an output of the graph
    theirs = _model([_table("block0/", FREQ), _table("block1/", FREQ)], ["block0/cos", "block1/cos"])
    assert not ShareRepeated(prefix="attnx/")(theirs).modified  # another tool's nodes: not attnx's to change
    assert len(list(theirs.graph)) == 11
