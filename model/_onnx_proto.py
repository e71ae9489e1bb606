"""An ONNX model file read without importing onnx: the part of onnx.proto that describe() reads.

Why: `import onnx` runs onnx/__init__, which imports onnx.helper and with it ml_dtypes, whose
extension alone took 0.55 s to load on an AMD EPYC (issue 30; measurements/inspect_startup.md).
Describing a model (attnx inspect, model_form, a package's external data) reads its metadata, the
structure of its graph and the headers of its tensors: none of onnx's helpers.

How: protobuf decodes a message with any subset of its fields declared (the others are kept as
unknown fields, their wire format still checked), and a released field of onnx.proto keeps its
number for ever: it is the file format every later onnx reads. So the messages below declare, with
onnx.proto's own names and numbers, only the fields attnx reads, in a descriptor pool of their own
(never protobuf's default pool, where onnx registers the whole file: the two never meet).
tests/model/test_onnx_proto.py checks each field against the installed onnx's descriptors, and
describe() against the same reading through onnx.load.
"""

from __future__ import annotations

import functools
import os
from typing import Any

__all__ = ["EXTERNAL", "FIELDS", "read_model"]

# TensorProto.DataLocation: the tensor's bytes are in another file (external_data says where).
EXTERNAL = 1

# Field types, as descriptor.proto numbers them (FieldDescriptorProto.Type).
_INT64, _INT32, _STRING, _MESSAGE = 3, 5, 9, 11

# message -> (field, number, type or the name of a message here, repeated). A dotted name is a
# nested message (TypeProto.Tensor), declared after its outer one. data_location is an enum in
# onnx.proto: read as int32 (the same varint), compared with EXTERNAL.
FIELDS: dict[str, tuple[tuple[str, int, int | str, bool], ...]] = {
    "ModelProto": (
        ("ir_version", 1, _INT64, False), ("producer_name", 2, _STRING, False),
        ("producer_version", 3, _STRING, False), ("graph", 7, "GraphProto", False),
        ("opset_import", 8, "OperatorSetIdProto", True), ("metadata_props", 14, "StringStringEntryProto", True),
        ("training_info", 20, "TrainingInfoProto", True), ("functions", 25, "FunctionProto", True),
    ),
    "OperatorSetIdProto": (("domain", 1, _STRING, False), ("version", 2, _INT64, False)),
    "StringStringEntryProto": (("key", 1, _STRING, False), ("value", 2, _STRING, False)),
    "GraphProto": (
        ("node", 1, "NodeProto", True), ("initializer", 5, "TensorProto", True),
        ("input", 11, "ValueInfoProto", True), ("output", 12, "ValueInfoProto", True),
        ("sparse_initializer", 15, "SparseTensorProto", True),
    ),
    "NodeProto": (
        ("input", 1, _STRING, True), ("output", 2, _STRING, True), ("op_type", 4, _STRING, False),
        ("attribute", 5, "AttributeProto", True), ("domain", 7, _STRING, False),
    ),
    "AttributeProto": (
        ("name", 1, _STRING, False), ("ints", 8, _INT64, True), ("t", 5, "TensorProto", False), ("g", 6, "GraphProto", False), ("tensors", 10, "TensorProto", True),
        ("graphs", 11, "GraphProto", True), ("sparse_tensor", 22, "SparseTensorProto", False),
        ("sparse_tensors", 23, "SparseTensorProto", True),
    ),
    "TensorProto": (
        ("dims", 1, _INT64, True), ("data_type", 2, _INT32, False), ("name", 8, _STRING, False),
        ("external_data", 13, "StringStringEntryProto", True), ("data_location", 14, _INT32, False),
    ),
    "SparseTensorProto": (
        ("values", 1, "TensorProto", False), ("indices", 2, "TensorProto", False), ("dims", 3, _INT64, True),
    ),
    "ValueInfoProto": (("name", 1, _STRING, False), ("type", 2, "TypeProto", False)),
    "TypeProto": (("tensor_type", 1, "TypeProto.Tensor", False),),
    "TypeProto.Tensor": (("elem_type", 1, _INT32, False), ("shape", 2, "TensorShapeProto", False)),
    "TensorShapeProto": (("dim", 1, "TensorShapeProto.Dimension", True),),
    "TensorShapeProto.Dimension": (("dim_value", 1, _INT64, False), ("dim_param", 2, _STRING, False)),
    "TrainingInfoProto": (("initialization", 1, "GraphProto", False), ("algorithm", 2, "GraphProto", False)),
    "FunctionProto": (("node", 7, "NodeProto", True),),
}  # fmt: skip


@functools.cache
def _model_class() -> Any:
    """The ModelProto class of FIELDS, built once (protobuf is imported here, when a file is read)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    file = descriptor_pb2.FileDescriptorProto(name="attnx/onnx_read.proto", package="onnx", syntax="proto2")
    messages: dict[str, Any] = {}
    for name, fields in FIELDS.items():
        outer, _, inner = name.rpartition(".")
        message = messages[outer].nested_type.add(name=inner) if outer else file.message_type.add(name=name)
        messages[name] = message
        for field, number, kind, repeated in fields:
            label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED if repeated else \
                descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL  # fmt: skip
            entry = message.field.add(name=field, number=number, label=label)
            if isinstance(kind, str):
                entry.type, entry.type_name = _MESSAGE, f".onnx.{kind}"
            else:
                entry.type = kind
    pool = descriptor_pool.DescriptorPool()  # attnx's own: onnx's full file lives in the default pool
    pool.AddSerializedFile(file.SerializeToString())
    descriptor = pool.FindMessageTypeByName("onnx.ModelProto")
    if hasattr(message_factory, "GetMessageClass"):  # protobuf >= 4.22
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


def read_model(path: str) -> Any:
    """The model at `path` as onnx.load(path, load_external_data=False) reads it, and raising what it
    raises (OSError, protobuf's DecodeError): a .onnx or .pb file (the binary format, which onnx
    reads from those names) with the fields of FIELDS; a file of any other name by onnx.load itself,
    which may read it in a text format (.textproto, .json, ...: onnx's registry of formats decides)."""
    if os.path.splitext(path)[1] not in (".onnx", ".pb"):
        import onnx

        return onnx.load(path, load_external_data=False)
    with open(path, "rb") as f:
        data = f.read()
    proto = _model_class()()
    decoded = proto.ParseFromString(data)
    if decoded is not None and decoded != len(data):  # as onnx's own deserializer checks
        from google.protobuf.message import DecodeError

        raise DecodeError(f"Protobuf decoding consumed too few bytes: {decoded} out of {len(data)}")
    return proto
