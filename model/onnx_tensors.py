"""An ONNX model's tensors walked without loading their data: every node (subgraphs and functions included), every
tensor an initializer, a Constant or a sparse initializer holds, their bytes, and the external data files they
name. What describe(), the package checks and the untrusted-file gate read a model file by."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from attnx.errors import ModelFileError
from attnx.model._onnx_proto import EXTERNAL
from attnx.model.dtypes import DTYPES, dtype_of_onnx

__all__ = ["all_nodes", "external_locations", "external_tensors", "initializer_bytes"]


def initializer_bytes(proto: Any) -> int:
    total = 0
    for tensor in proto.graph.initializer:
        total += int(np.prod(tensor.dims, dtype=np.int64)) * _itemsize(tensor.data_type)
    return total


def _itemsize(elem_type: int) -> int:
    """Bytes per element of an ONNX element type, as numpy holds it: from DTYPES, or for a type
    numpy has not (bf16, int4, float8, ...) from onnx's own table (it imports ml_dtypes, whose types
    those are: only for such a tensor, which attnx never writes)."""
    d = DTYPES.get(dtype_of_onnx(elem_type))
    if d is not None and d.numpy is not None:
        return np.dtype(d.numpy).itemsize
    from onnx import helper

    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize


def external_tensors(proto: Any, path: str) -> list[Any]:
    tensors = list(_tensors(proto.graph))
    for function in proto.functions:
        tensors += list(_node_tensors(function.node))
    for info in proto.training_info:
        tensors += list(_tensors(info.initialization)) + list(_tensors(info.algorithm))
    out = []
    for t in tensors:
        entries = {e.key: e.value for e in t.external_data}
        if t.data_location == EXTERNAL or entries:
            if "location" not in entries:
                raise ModelFileError(f"tensor {t.name!r} of {os.path.basename(path)!r} is external but has no location")
            out.append(t)
    return out


def external_locations(proto: Any, path: str) -> list[str]:
    locations: list[str] = []
    for t in external_tensors(proto, path):
        location = next(e.value for e in t.external_data if e.key == "location")
        if location not in locations:
            locations.append(location)
    return locations


def all_nodes(graph: Any) -> Iterator[Any]:
    """Every NodeProto of an onnx graph, its nodes' subgraphs (If branches, Loop and Scan bodies)
    included, each after the node that holds it."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from all_nodes(sub)


def _tensors(graph: Any) -> Iterator[Any]:
    """Every TensorProto of a graph, its nodes' attributes and subgraphs included."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Any) -> Iterator[Any]:
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            sparse = list(attr.sparse_tensors) + ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else [])
            for tensor in sparse:
                yield tensor.values
                yield tensor.indices
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)
