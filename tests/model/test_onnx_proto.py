"""describe() reads a model file without onnx (attnx.model._onnx_proto): the part of onnx.proto it
declares is onnx's own, field by field, and describe() reads every model as onnx.load does."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnx.model import contract
from attnx.model._onnx_proto import EXTERNAL, FIELDS, read_model
from attnx.model.contract import describe, external_data_locations

SCALARS = {3: "int64", 5: "int32", 9: "string"}  # FieldDescriptor types used in FIELDS


def test_every_field_read_is_onnx_s_own():
    for message, fields in FIELDS.items():
        theirs = onnx.ModelProto.DESCRIPTOR.file.pool.FindMessageTypeByName(f"onnx.{message}")
        for name, number, kind, repeated in fields:
            f = theirs.fields_by_name[name]
            assert (f.number, f.type == f.TYPE_MESSAGE) == (number, isinstance(kind, str)), (message, name)
            is_repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED  # protobuf < 6
            assert is_repeated == repeated, (message, name)
            if isinstance(kind, str):
                assert f.message_type.full_name == f"onnx.{kind}", (message, name)
            elif f.type == f.TYPE_ENUM:  # data_location: read as the varint it is
                assert (name, kind, f.enum_type.values_by_name["EXTERNAL"].number) == ("data_location", 5, EXTERNAL)
            else:
                assert f.type == kind, (message, name, SCALARS.get(kind))


def _as_onnx_reads_it(monkeypatch, path):
    """describe(path) and its external data, read through onnx.load instead."""
    with monkeypatch.context() as m:
        m.setattr(contract, "read_model", lambda p: onnx.load(p, load_external_data=False))
        return describe(path).to_dict(), external_data_locations(path)


def _every_kind_of_tensor(path):
    """A model with what describe() walks: an If's branches, a function, training info, sparse and
    external tensors (in an initializer, an attribute and a subgraph), a sequence input, and element
    types numpy has not (bf16, int4, float8): their sizes come from onnx's table."""
    const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones((2, 3), np.float32)))
    branch = helper.make_graph([helper.make_node("Identity", ["c"], ["b"])], "then",
                               [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n", 3])],
                               initializer=[helper.make_tensor("sub", TensorProto.INT64, [4], [1, 2, 3, 4])])  # fmt: skip
    if_node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
    sparse = helper.make_sparse_tensor(helper.make_tensor("sv", TensorProto.FLOAT, [2], [1.0, 2.0]),
                                       helper.make_tensor("si", TensorProto.INT64, [2], [0, 3]), [4])  # fmt: skip
    external = helper.make_tensor("ext", TensorProto.FLOAT, [8], np.zeros(8, np.float32).tobytes(), raw=True)
    external.data_location = TensorProto.EXTERNAL
    external.ClearField("raw_data")
    for key, value in (("location", "w.data"), ("offset", "0"), ("length", "32")):
        external.external_data.add(key=key, value=value)
    odd = [TensorProto(name=f"t{t}", data_type=t, dims=[3, 5])  # headers alone: describe reads no data
           for t in (TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN, TensorProto.INT4, TensorProto.UINT16)]  # fmt: skip
    graph = helper.make_graph(
        [const, if_node, helper.make_node("Fn", ["y"], ["z"], domain="local")], "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT16, ["batch", 3])],
        initializer=[external, *odd], sparse_initializer=[sparse],
    )  # fmt: skip
    fn = helper.make_function("local", "Fn", ["a"], ["b"], [helper.make_node("Identity", ["a"], ["b"])],
                              [helper.make_opsetid("", 18)])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("local", 1)],
                              functions=[fn], producer_name="p", producer_version="1")  # fmt: skip
    info = model.training_info.add()
    info.initialization.CopyFrom(helper.make_graph([], "init", [], [], initializer=[external]))
    quant = {"dtype": "int8", "op": "DynamicQuantizeMatMul", "bits": 8,
             "projections": {"q": {"k": 4, "n": 4, "step_rms": 0.1, "rel_error": 0.01}}}  # fmt: skip
    helper.set_model_props(model, {"k": "v", contract.QUANT_KEY: json.dumps(quant)})
    model.ir_version = 10
    onnx.save(model, path)


def test_describe_reads_every_model_as_onnx_load_does(exported, tmp_path, monkeypatch):
    _every_kind_of_tensor(str(tmp_path / "every.onnx"))
    paths = [exported("self"), str(tmp_path / "every.onnx")]
    for path in paths:
        assert (describe(path).to_dict(), external_data_locations(path)) == _as_onnx_reads_it(monkeypatch, path)
    info = describe(tmp_path / "every.onnx")
    assert info.quantization is not None and info.to_dict()["quantization"]["bits"] == 8
    assert info.external_data == ("w.data",)
    assert info.operators == {"Constant": 1, "If": 1, "local.Fn": 1, "Identity": 2}  # the branches' too
    assert info.initializer_bytes == 32 + 15 * (2 + 1 + 1 + 2)  # fp32 [8]; bf16, float8, int4, uint16 [3, 5]


def test_a_text_format_is_read_by_onnx_as_onnx_load_reads_it(exported, tmp_path, monkeypatch):
    text = tmp_path / "m.textproto"
    onnx.save(onnx.load(exported("self")), str(text))  # onnx picks the text format from the name
    info = describe(text)
    assert (info.config, info.operators) == (describe(exported("self")).config, describe(exported("self")).operators)
    assert describe(text).to_dict() == _as_onnx_reads_it(monkeypatch, str(text))[0]


def test_reading_a_model_imports_neither_onnx_nor_ml_dtypes(exported):
    probe = ("import sys; from attnx.model.contract import describe; describe(sys.argv[1]); "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'ml_dtypes', 'onnxruntime'}))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe, exported("self")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_a_file_that_is_not_a_model_is_refused_as_onnx_refuses_it(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\xff\xff\xff")
    with pytest.raises(Exception) as ours:
        read_model(str(junk))
    with pytest.raises(Exception) as theirs:
        onnx.load(str(junk), load_external_data=False)
    assert type(ours.value) is type(theirs.value)
