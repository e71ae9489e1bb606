"""Files attnx did not make are untrusted input (attnx.runtimes._untrusted): each unsafe or unsound file is
refused with one line naming the tensor, node or path (UsageError in Python, exit 2 on the CLI), before
onnx-ir, onnx's Extractor or a runtime parses it for real; through `attnx audit` and `attnx parity --model`.

The files are copies of the builder's llama (tests/fixtures/genai), each changed in one way."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnx.cli import main
from attnx.errors import UsageError
from attnx.runtimes import _untrusted
from attnx.runtimes._untrusted import check_untrusted_model
from attnx.workflows.audit import audit_model

LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "genai" / "llama" / "fp32"
BIG = [1_000_000, 1_000_000]  # 10^12 elements: 4e12 bytes of float32


def _variant(tmp_path: Path, change: Callable[[onnx.ModelProto], None]) -> str:
    """The llama fixture's graph, changed, saved beside a copy of its external data (its own tensors stay
    external; what `change` adds is written inline)."""
    proto = onnx.load(str(LLAMA / "model.onnx"), load_external_data=False)
    change(proto)
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copyfile(LLAMA / "model.onnx.data", folder / "model.onnx.data")
    onnx.save(proto, str(folder / "model.onnx"))
    return str(folder / "model.onnx")


def _node(proto: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in proto.graph.node if n.name == name)


def _init(proto: onnx.ModelProto, name: str) -> onnx.TensorProto:
    return next(t for t in proto.graph.initializer if t.name == name)


SIGMOID, MUL = "/model/layers.0/mlp/act_fn/Sigmoid", "/model/layers.0/mlp/act_fn/Mul"
QKV, NORM = "/model/layers.0/attn/qkv_proj/MatMul", "/model/layers.0/input_layernorm/LayerNorm"


def _inline_claims_too_much(p):  # raw_data of 16 bytes under dims of 10^12 elements
    p.graph.initializer.append(TensorProto(name="inline_big", data_type=TensorProto.FLOAT, dims=BIG, raw_data=b"\0" * 16))


def _external_claims_too_much(p):  # the o_proj weight's 16384 bytes (its length entry) under dims of 10^12
    t = _init(p, "model.layers.0.attn.o_proj.MatMul.weight")
    del t.dims[:]
    t.dims.extend(BIG)


def _external_without_length(p):  # no length entry: the runtime reads the dims' bytes from the offset on
    t = _init(p, "model.layers.0.attn.o_proj.MatMul.weight")
    del t.dims[:]
    t.dims.extend(BIG)
    kept = [e for e in t.external_data if e.key != "length"]
    del t.external_data[:]
    t.external_data.extend(kept)


def _typed_values_short(p):  # dims [4], three float_data values
    p.graph.initializer.append(TensorProto(name="short", data_type=TensorProto.FLOAT, dims=[4], float_data=[1, 2, 3]))


def _constant_claims_too_much(p):
    value = TensorProto(data_type=TensorProto.FLOAT, dims=BIG, raw_data=b"\0" * 4)
    p.graph.node.insert(0, helper.make_node("Constant", [], ["big_constant"], name="big_constant", value=value))


def _constant_of_shape(p):  # a shape of 10^12 elements from a Constant: ONNX Runtime folds it when it opens the graph
    shape = helper.make_tensor("", TensorProto.INT64, [2], BIG)
    p.graph.node.insert(0, helper.make_node("Constant", [], ["big_shape"], name="big_shape", value=shape))
    p.graph.node.insert(1, helper.make_node("ConstantOfShape", ["big_shape"], ["zeros"], name="zeros"))


def _cycle_through_the_block(p):  # layer 0's norm reads its attention's output projection
    _node(p, NORM).input[0] = "/model/layers.0/attn/o_proj/MatMul/output_0"


def _two_node_cycle(p):  # Sigmoid reads Mul's output, Mul reads Sigmoid's
    _node(p, SIGMOID).input[0] = _node(p, MUL).output[0]


def _self_loop(p):
    node = _node(p, SIGMOID)
    node.input[0] = node.output[0]


def _two_writers(p):
    _node(p, MUL).output[0] = _node(p, SIGMOID).output[0]


def _unknown_domain(p):
    _node(p, SIGMOID).domain = "custom.evil"
    p.opset_import.append(helper.make_opsetid("custom.evil", 1))


def _opset(domain, version):
    def change(p):
        for o in p.opset_import:
            if o.domain == domain:
                o.version = version

    return change


CASES = {
    "inline data under dims of 10^12": (_inline_claims_too_much, "initializer 'inline_big' (dims [1000000, 1000000], FLOAT) "
                                        "claims 4000000000000 bytes, and its raw_data holds 16: refused"),
    "external data under dims of 10^12": (_external_claims_too_much, "initializer 'model.layers.0.attn.o_proj.MatMul.weight' "
                                          "(dims [1000000, 1000000], FLOAT) claims 4000000000000 bytes, and its external "
                                          "data's length is 16384: refused"),
    "external data without a length": (_external_without_length, "initializer 'model.layers.0.attn.o_proj.MatMul.weight' "
                                       "(dims [1000000, 1000000], FLOAT) claims 4000000000000 bytes, and "
                                       "'model.onnx.data' holds "),
    "typed values short of the dims": (_typed_values_short, "initializer 'short' (dims [4], FLOAT) claims 4 float_data "
                                       "values, and it holds 3: refused"),
    "a Constant under dims of 10^12": (_constant_claims_too_much, "node 'big_constant' attribute 'value' "
                                       "(dims [1000000, 1000000], FLOAT) claims 4000000000000 bytes, and its raw_data holds 4"),
    "a ConstantOfShape of 10^12": (_constant_of_shape, "node 'zeros' (ConstantOfShape of shape [1000000, 1000000]) claims "
                                   "4000000000000 bytes (3725.3 GB), more than the "),
    "a cycle through the attention block": (_cycle_through_the_block, f"node '{NORM}': the graph has a cycle of 4 "
                                            f"node(s) through '{NORM}' -> '{QKV}' -> "
                                            "'/model/layers.0/attn/GroupQueryAttention' -> "
                                            f"'/model/layers.0/attn/o_proj/MatMul' -> '{NORM}': refused"),
    "a cycle of two nodes": (_two_node_cycle, f"node '{SIGMOID}': the graph has a cycle of 2 node(s) through "
                             f"'{SIGMOID}' -> '{MUL}' -> '{SIGMOID}': refused"),
    "a node reading its own output": (_self_loop, f"node '{SIGMOID}': the graph has a cycle of 1 node(s) through "
                                      f"'{SIGMOID}' -> '{SIGMOID}': refused"),
    "two nodes writing one tensor": (_two_writers, f"node '{MUL}': its output '{SIGMOID}/output_0' is also written by node "
                                     f"'{SIGMOID}': a tensor has one producer: refused"),
    "a node in an unknown domain": (_unknown_domain, f"node '{SIGMOID}' (Sigmoid) is in operator domain 'custom.evil', "
                                    "which no backend attnx runs knows (the ONNX default domain, ai.onnx.ml, "
                                    "com.microsoft) and no function of the model defines: refused"),
    "the default domain at opset 99": (_opset("", 99), "opset_import ai.onnx version 99: newer than any onnx "),
    "com.microsoft at version 2": (_opset("com.microsoft", 2), "opset_import com.microsoft version 2: com.microsoft has "
                                   "only version 1: refused"),
}  # fmt: skip


@pytest.fixture
def nothing_parsed(monkeypatch):
    """onnx-ir's load and onnx's Extractor fail the test: the refusal comes before the model is parsed for real."""
    import onnx.utils
    import onnx_ir

    def parsed(*_a, **_k):
        raise AssertionError("the model was parsed for real before it was refused")

    monkeypatch.setattr(onnx_ir, "load", parsed)
    monkeypatch.setattr(onnx.utils, "Extractor", parsed)


@pytest.mark.parametrize("case", CASES)
def test_an_untrusted_file_is_refused_in_one_line_before_it_is_parsed(tmp_path, capsys, nothing_parsed, case):
    change, message = CASES[case]
    path = _variant(tmp_path, change)
    with pytest.raises(UsageError) as raised:
        audit_model(path)
    assert str(raised.value).startswith(f"{path}: {message}"), str(raised.value)
    assert main(["audit", path]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"attnx audit: error: {path}: {message}")  # the memory available may move between the two


def test_a_tensor_larger_than_the_memory_available_is_refused_naming_it(tmp_path, capsys, nothing_parsed, monkeypatch):
    """The unchanged fixture, on a machine with 40000 bytes free: its embedding (256 x 64 float32) does not fit."""
    monkeypatch.setattr(_untrusted, "available_memory_bytes", lambda: 40_000)
    path = str(LLAMA / "model.onnx")
    assert main(["audit", path]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"attnx audit: error: {path}: initializer 'model.embed_tokens.weight' (dims [256, 64], FLOAT) claims 65536 "
        "bytes (0.0 GB), more than the 40000 bytes (0.0 GB) available on this machine: refused before allocating it"
    ]


def test_a_block_whose_cut_does_not_fit_is_refused_before_its_data_is_read(tmp_path, capsys, monkeypatch):
    """100000 bytes free: every tensor fits (the largest, 65536), block 0's cut does not (its tensors, three times)."""
    monkeypatch.setattr(_untrusted, "available_memory_bytes", lambda: 100_000)
    import onnx.external_data_helper

    def read(*_a, **_k):
        raise AssertionError("the block's data was read before it was refused")

    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", read)
    path = str(LLAMA / "model.onnx")
    with pytest.raises(UsageError, match=r"^block 0 \(/model/layers.0/attn/GroupQueryAttention\) needs about \d+ bytes"):
        audit_model(path)
    assert main(["audit", path]) == 2
    *progress, error = capsys.readouterr().err.strip().splitlines()
    assert progress == ["auditing block 0: /model/layers.0/attn/GroupQueryAttention"]
    assert error.startswith("attnx audit: error: block 0 (/model/layers.0/attn/GroupQueryAttention) needs about ")
    assert error.endswith("100000 bytes (0.0 GB) available on this machine: refused before reading its data")


def _function_sigmoid(p):
    """Sigmoid as a call of a function the model defines, in a domain of its own."""
    body = helper.make_node("Sigmoid", ["a"], ["b"])
    p.functions.append(helper.make_function("local.fn", "MySigmoid", ["a"], ["b"], [body],
                                            [helper.make_opsetid("", 22)]))  # fmt: skip
    node = _node(p, SIGMOID)
    node.domain, node.op_type = "local.fn", "MySigmoid"
    p.opset_import.append(helper.make_opsetid("local.fn", 1))


def _unused_domain(p):
    p.opset_import.append(helper.make_opsetid("custom.unused", 3))


@pytest.mark.parametrize("change", [_function_sigmoid, _unused_domain])
def test_a_function_of_the_model_and_an_unused_opset_import_are_accepted(tmp_path, change):
    assert audit_model(_variant(tmp_path, change), layers=[0]).passed


def test_functions_that_call_each_other_are_refused():
    a = helper.make_function("local.fn", "A", ["x"], ["y"], [helper.make_node("B", ["x"], ["y"], domain="local.fn")],
                             [helper.make_opsetid("local.fn", 1)])  # fmt: skip
    b = helper.make_function("local.fn", "B", ["x"], ["y"], [helper.make_node("A", ["x"], ["y"], domain="local.fn")],
                             [helper.make_opsetid("local.fn", 1)])  # fmt: skip
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("A", ["x"], ["y"], domain="local.fn", name="call")], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid("local.fn", 1)],
                              functions=[a, b], ir_version=10)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="untrusted-") as folder:
        path = os.path.join(folder, "m.onnx")
        onnx.save(model, path)
        with pytest.raises(UsageError, match=r"function 'A': the functions call each other in a cycle through "
                                             r"'local.fn:A' -> 'local.fn:B' -> 'local.fn:A'"):  # fmt: skip
            check_untrusted_model(path)


def test_a_cycle_inside_a_subgraph_is_refused(tmp_path):
    """An If's branch whose two nodes read each other: the walk goes into subgraphs, iteratively."""
    out = helper.make_tensor_value_info("r", TensorProto.FLOAT, [2])
    branch = helper.make_graph([helper.make_node("Neg", ["s"], ["r"], name="neg"),
                                helper.make_node("Abs", ["r"], ["s"], name="abs")], "branch", [], [out])  # fmt: skip
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    node = helper.make_node("If", ["c"], ["y"], name="if", then_branch=branch, else_branch=branch)
    model = helper.make_model(helper.make_graph([node], "g", [cond], [y]),
                              opset_imports=[helper.make_opsetid("", 22)], ir_version=10)  # fmt: skip
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    with pytest.raises(UsageError, match="node 'neg': the graph has a cycle of 2 node.s. through 'neg' -> 'abs' -> 'neg'"):
        check_untrusted_model(path)


def test_a_long_chain_is_walked_without_recursion(tmp_path):
    """20000 nodes in a chain, closed into a cycle at its end: found, no RecursionError, no hang."""
    nodes = [helper.make_node("Relu", [f"t{i - 1}" if i else f"t{19_999}"], [f"t{i}"], name=f"n{i}") for i in range(20_000)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("t19999", TensorProto.FLOAT, [2])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 22)],
                              ir_version=10)  # fmt: skip
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    with pytest.raises(UsageError, match=r"node 'n0': the graph has a cycle of 20000 node\(s\) through 'n0' -> 'n1' -> "
                                         r"'n2' -> 'n3' -> \.\.\. 19994 more \.\.\. -> 'n19998' -> 'n19999' -> 'n0': refused$"):
        check_untrusted_model(path)


@pytest.mark.parametrize("key,value", [("offset", "-8"), ("length", "lots")])
def test_an_external_data_offset_or_length_that_is_not_a_number_is_refused(tmp_path, key, value):
    def change(p):
        t = _init(p, "cos_cache")
        for e in t.external_data:
            if e.key == key:
                e.value = value

    path = _variant(tmp_path, change)
    with pytest.raises(UsageError, match=f"tensor 'cos_cache' gives its external data {key} '{value}', not a whole "
                                         "number of bytes: refused"):  # fmt: skip
        audit_model(path)


def test_the_audit_writes_nothing_but_its_json(tmp_path, monkeypatch):
    """The model's folder, the working folder and the temporary folder hold the same files after an audit on
    both backends (OpenVINO's copy of each cut lives in a temporary folder, removed), but the --json report."""
    path = _variant(tmp_path, lambda p: None)
    cwd, temp = tmp_path / "cwd", tmp_path / "temp"
    cwd.mkdir()
    temp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    def files() -> dict[str, list[str]]:
        return {str(d): sorted(os.listdir(d)) for d in (os.path.dirname(path), cwd, temp)}

    before = files()
    main(["audit", path, "--backends", "ort-cpu,openvino", "--layers", "0", "--json", "report.json"])
    after = files()
    assert after.pop(str(cwd)) == ["report.json"] and before.pop(str(cwd)) == []
    assert after == before
    report = json.loads((cwd / "report.json").read_text())  # OpenVINO ran (its cut went through a file) or is not here
    assert report["skipped"] or any("openvino" in f for f in report["blocks"][0]["findings"]), report


# attnx parity --model: the same rule --------------------------------------------------------------
def _self_model(exported, tmp_path: Path, change: Callable[[onnx.ModelProto], None]) -> str:
    proto = onnx.load(exported("self", "ort-fused"))
    change(proto)
    path = str(tmp_path / "model.onnx")
    onnx.save(proto, path)
    return path


def _parity_cycle(p):
    """A node's producer made to read that node's output: the two read each other."""
    producer = {out: n for n in p.graph.node for out in n.output}
    consumer = next(n for n in p.graph.node if n.input and n.input[0] in producer)
    producer[consumer.input[0]].input[0] = consumer.output[0]


@pytest.mark.parametrize("backends", ["reference,openvino", "reference,ort-cpu"])
def test_parity_refuses_a_cyclic_model_for_every_backend(exported, tmp_path, capsys, backends):
    path = _self_model(exported, tmp_path, _parity_cycle)
    assert main(["parity", "--model", path, "--backends", backends, "--seq", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the graph has a cycle of 2 node(s) through 'q_proj/MatMul' -> " in err[0], err


def test_parity_refuses_a_model_whose_tensors_together_exceed_max_mem_gb(exported, tmp_path, capsys):
    """parity's runtimes hold every tensor at once: their sum against --max-mem-gb (or the memory available)."""
    path = _self_model(exported, tmp_path, lambda p: None)
    total = sum(_untrusted.tensor_bytes(t) for t in onnx.load(path).graph.initializer)
    limit = total / 2 / 1024**3
    assert main(["parity", "--model", path, "--backends", "reference,ort-cpu", "--seq", "3",
                 "--max-mem-gb", repr(limit)]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert f"its tensors together claim {total} bytes" in err and "allowed by --max-mem-gb" in err, err


def test_tensor_bytes_counts_packed_types():
    assert _untrusted.tensor_bytes(numpy_helper.from_array(np.zeros((3, 5), np.float16))) == 30
    assert _untrusted.tensor_bytes(TensorProto(dims=[3, 5], data_type=TensorProto.INT4)) == 8  # 15 nibbles
    assert _untrusted.tensor_bytes(TensorProto(dims=[0, 7], data_type=TensorProto.DOUBLE)) == 0
