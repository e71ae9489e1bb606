"""A model file attnx did not make, checked as untrusted input before anything parses it for real.

`check_untrusted_model` reads the model's protobuf without its external data (onnx.load with
load_external_data=False: the data files are stat'ed, never read; `read_untrusted_model` returns that protobuf
to a caller that goes on to use it, so the file is parsed once) and refuses (UsageError, exit 2)
with one line naming the tensor, node or path:

- external data outside the model's folder, missing or truncated (attnx.runtimes.package.check_external_data);
- a tensor whose dims and data type claim another number of bytes than its data holds (inline
  raw_data or typed fields, or its external data's `length`, or the file past its `offset`);
- a tensor (initializer, sparse initializer's dense shape, a node attribute's tensor such as a
  Constant's value) or a ConstantOfShape output of a constant shape that claims more bytes than the
  memory available: onnx, onnx-ir and ONNX Runtime would allocate it (ONNX Runtime folds constants
  when it opens a graph); with whole_model (a runtime that holds every tensor at once), their sum;
- a node in an operator domain no backend attnx runs knows: neither the ONNX default domain
  ('' or 'ai.onnx'), 'ai.onnx.ml' nor 'com.microsoft', nor a function the model defines;
- an opset_import of the default domain or ai.onnx.ml newer than the installed onnx defines (the
  cut a block is run as is typed with onnx's shape inference), or of com.microsoft other than 1 (its
  only version); an opset_import of another domain that no node uses is ignored, as runtimes do;
- two nodes writing the same tensor, and a cycle (a node that reads, through others, its own
  output), in the graph, its subgraphs or a function; or functions that call each other in a cycle.

Every walk here is iterative (a stack, Kahn's algorithm), so a deep or cyclic graph neither hangs
nor recurses without bound. `check_cut_fits` holds a block cut out of the graph against the memory
available before its external data is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from attnx.errors import ModelFileError, UsageError
from attnx.model.contract import require_model_file
from attnx.model.resources import GB, ResourceError, available_memory_bytes
from attnx.runtimes._manifest import check_external_data

__all__ = ["KNOWN_DOMAINS", "check_cut_fits", "check_untrusted_model", "read_untrusted_model", "tensor_bytes"]

# The operator domains a backend attnx runs knows ('ai.onnx' is the default domain's other name).
KNOWN_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft")
_MICROSOFT_VERSION = 1  # com.microsoft has one version (ONNX Runtime refuses any other)
_SHAPE_VALUES = 64  # a constant shape read to bound ConstantOfShape: at most this many values

# TensorProto.DataType -> bits per element where it is not the numpy itemsize of its type
_PACKED_BITS = {"INT4": 4, "UINT4": 4, "FLOAT4E2M1": 4, "INT2": 2, "UINT2": 2, "FLOAT6E2M3": 6, "FLOAT6E3M2": 6}
# typed fields holding packed values: elements per int32_data entry
_PER_ENTRY = {"INT4": 2, "UINT4": 2, "FLOAT4E2M1": 2, "INT2": 4, "UINT2": 4}


def check_untrusted_model(model_path: str, *, whole_model: bool = False, max_mem_gb: float | None = None) -> None:
    """Refuse (UsageError, exit 2) a model file that is unsafe or unsound to parse and run (the module's
    list), reading its protobuf only. whole_model: the caller's runtime holds every tensor at once (attnx
    parity), so their sum must fit too; max_mem_gb: the memory allowed instead of the memory available."""
    read_untrusted_model(model_path, whole_model=whole_model, max_mem_gb=max_mem_gb)


def read_untrusted_model(model_path: str, *, whole_model: bool = False, max_mem_gb: float | None = None) -> Any:
    """check_untrusted_model's checks, and the ModelProto they were made on (read once, without its external
    data): what a caller that goes on to use the model reads instead of parsing the file again."""
    import onnx

    require_model_file(model_path)
    try:
        proto = onnx.load_model(model_path, load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf's and onnx's own error types: not a model
        raise ModelFileError(f"{model_path!r} is not an ONNX model: {str(e).strip()[:200] or type(e).__name__}") from None
    if not proto.graph.node and not proto.graph.input and not proto.graph.output:
        # protobuf parses many non-ONNX byte strings as an empty ModelProto (attnx.model.contract's rule)
        raise ModelFileError(f"{model_path!r} is not an ONNX model: it has no graph")
    check_external_data(model_path, proto)
    where = f"{model_path}: "
    _check_opsets(proto, where)
    functions = {(f.domain, f.name) for f in proto.functions}
    graphs = list(_graphs(proto))
    for nodes, _ in graphs:
        for node in nodes:
            if node.domain not in KNOWN_DOMAINS and (node.domain, node.op_type) not in functions:
                raise UsageError(f"{where}node {_name(node)} ({node.op_type}) is in operator domain {node.domain!r}, which "
                                 "no backend attnx runs knows (the ONNX default domain, ai.onnx.ml, com.microsoft) and no "
                                 "function of the model defines: refused")  # fmt: skip
        _check_acyclic(nodes, where)
    _check_function_calls(proto, where)
    base_dir = os.path.dirname(os.path.abspath(model_path))
    limit, source = _memory_limit(max_mem_gb)
    total = 0
    for label, tensor, dense in _tensors(proto):
        claimed = _checked_bytes(label, tensor, dense, base_dir, where)
        total += claimed
        _check_fits(f"{label} ({_shape_words(tensor, dense)})", claimed, limit, source, where)
    for nodes, constants in graphs:
        for node in nodes:
            if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx"):
                claimed = _constant_of_shape_bytes(node, constants, base_dir)
                if claimed is not None:
                    total += claimed[0]
                    _check_fits(f"node {_name(node)} (ConstantOfShape of shape {claimed[1]})", claimed[0], limit, source,
                                where)  # fmt: skip
    if whole_model:
        _check_fits("its tensors together", total, limit, source, where, verb="claim")
    return proto


def check_cut_fits(cut: Any, base_dir: str, what: str) -> None:
    """Refuse (ResourceError, exit 2) a block cut out of the graph (a ModelProto whose external data is not
    read yet) when the bytes its tensors claim, held three times (the cut with its data, its serialized
    copy, a runtime's own), exceed the memory available: before any of its data is read."""
    tensors = sum(_claimed(t, sparse) for _, t, sparse in _tensors(cut))
    limit, source = _memory_limit(None)
    if limit is not None and 3 * tensors > limit:
        raise ResourceError(f"{what} needs about {3 * tensors} bytes ({3 * tensors / GB:.1f} GB): its tensors' "
                            f"{tensors} bytes held three times (the cut with its data, its serialized copy, a runtime's "
                            f"copy); {limit} bytes ({limit / GB:.1f} GB) {source}: refused before reading its data")  # fmt: skip


def tensor_bytes(tensor: Any) -> int:
    """The bytes a TensorProto's dims and data type claim (strings: 0, their bytes are inline)."""
    import onnx

    name = onnx.TensorProto.DataType.Name(tensor.data_type)
    n = math.prod(tensor.dims)
    if name == "STRING":
        return 0
    bits = _PACKED_BITS.get(name) or 8 * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return -(-n * bits // 8)


# Opsets, names, graphs --------------------------------------------------------------------------
def _check_opsets(proto: Any, where: str) -> None:
    import onnx

    newest: dict[str, int] = {}
    for (domain, version), _ir in onnx.helper.OP_SET_ID_VERSION_MAP.items():
        newest[domain] = max(newest.get(domain, 0), version)
    for opset in proto.opset_import:
        domain = opset.domain or "ai.onnx"
        if domain in ("ai.onnx", "ai.onnx.ml") and opset.version > newest[domain]:
            raise UsageError(f"{where}opset_import {domain} version {opset.version}: newer than any onnx "
                             f"{onnx.__version__} defines ({newest[domain]}): refused")  # fmt: skip
        if domain == "com.microsoft" and opset.version != _MICROSOFT_VERSION:
            raise UsageError(f"{where}opset_import com.microsoft version {opset.version}: com.microsoft has only "
                             f"version {_MICROSOFT_VERSION}: refused")  # fmt: skip


def _name(node: Any) -> str:
    return repr(node.name) if node.name else f"<unnamed {node.op_type}>"


def _subgraphs(node: Any) -> Iterator[Any]:
    for a in node.attribute:
        if a.HasField("g"):
            yield a.g
        yield from a.graphs


def _graphs(proto: Any) -> Iterator[tuple[Sequence[Any], dict[str, Any]]]:
    """(nodes, {name: the initializer or Constant node it comes from}) of the main graph, each function's
    body and each subgraph of theirs (an If's branches, a Loop's body); iterative."""
    stack: list[Any] = [proto.graph, *proto.functions]
    while stack:
        graph = stack.pop()
        constants: dict[str, Any] = {t.name: t for t in getattr(graph, "initializer", ())}  # a function has none
        for node in graph.node:
            if node.op_type == "Constant" and node.output:
                constants[node.output[0]] = node
            stack.extend(_subgraphs(node))
        yield graph.node, constants


def _reads(node: Any) -> Iterator[str]:
    """The tensors a node reads: its inputs and every name its subgraphs read (from the outer scope, the
    ones that matter for the order of the outer graph's nodes)."""
    yield from node.input
    stack = list(_subgraphs(node))
    while stack:
        graph = stack.pop()
        for inner in graph.node:
            yield from inner.input
            stack.extend(_subgraphs(inner))


# Cycles -------------------------------------------------------------------------------------------
def _find_cycle(deps: Sequence[set[int]]) -> list[int] | None:
    """One cycle of the graph whose item i depends on the items deps[i], in the order data flows along it
    (each item depends on the one before it), or None (Kahn's algorithm, then a walk among what it left)."""
    users: list[list[int]] = [[] for _ in deps]
    waiting = [len(d) for d in deps]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    left = set(range(len(deps)))
    while ready:
        i = ready.pop()
        left.discard(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                ready.append(u)
    if not left:
        return None
    # every item left depends on another item left: walk back along them until one repeats
    path: list[int] = []
    at: dict[int, int] = {}
    i = min(left)
    while i not in at:
        at[i] = len(path)
        path.append(i)
        i = min(j for j in deps[i] if j in left)
    cycle = path[at[i] :][::-1]
    first = cycle.index(min(cycle))  # from its first item in graph order
    return cycle[first:] + cycle[:first]


def _through(names: list[str]) -> str:
    """A cycle in words, back to its start; a long one by its ends."""
    shown = names if len(names) <= 8 else [*names[:4], f"... {len(names) - 6} more ...", *names[-2:]]
    return " -> ".join([*shown, names[0]])


def _check_acyclic(nodes: Sequence[Any], where: str) -> None:
    producer: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for out in node.output:
            if not out:
                continue
            if out in producer:
                raise UsageError(f"{where}node {_name(node)}: its output {out!r} is also written by node "
                                 f"{_name(nodes[producer[out]])}: a tensor has one producer: refused")  # fmt: skip
            producer[out] = i
    deps = [{producer[name] for name in _reads(node) if name in producer} for node in nodes]
    cycle = _find_cycle(deps)
    if cycle is not None:
        through = _through([_name(nodes[i]) for i in cycle])
        raise UsageError(f"{where}node {_name(nodes[cycle[0]])}: the graph has a cycle of {len(cycle)} node(s) through "
                         f"{through}: refused")  # fmt: skip


def _check_function_calls(proto: Any, where: str) -> None:
    functions = list(proto.functions)
    index = {(f.domain, f.name): i for i, f in enumerate(functions)}
    deps = []
    for f in functions:
        called: set[int] = set()
        stack = [list(f.node)]
        while stack:
            for node in stack.pop():
                if (node.domain, node.op_type) in index:
                    called.add(index[(node.domain, node.op_type)])
                stack.extend(list(g.node) for g in _subgraphs(node))
        deps.append(called)
    cycle = _find_cycle(deps)
    if cycle is not None:
        through = _through([repr(f"{functions[i].domain}:{functions[i].name}") for i in cycle])
        raise UsageError(f"{where}function {functions[cycle[0]].name!r}: the functions call each other in a cycle "
                         f"through {through}: refused")  # fmt: skip


# Tensors and memory -------------------------------------------------------------------------------
def _tensors(proto: Any) -> Iterator[tuple[str, Any, Any]]:
    """(label, TensorProto, the SparseTensorProto it belongs to or None) of every tensor of the graph, its
    nodes' attributes, its subgraphs and its functions; iterative."""
    stack: list[tuple[Any, str]] = [(proto.graph, "")]
    nodes: list[tuple[Any, str]] = [(n, "") for f in proto.functions for n in f.node]
    while stack or nodes:
        if stack:
            graph, inside = stack.pop()
            for t in graph.initializer:
                yield f"{inside}initializer {t.name!r}", t, None
            for s in graph.sparse_initializer:
                yield f"{inside}sparse initializer {s.values.name!r}", s.values, s
                yield f"{inside}sparse initializer {s.values.name!r}'s indices", s.indices, None
            nodes.extend((n, inside) for n in graph.node)
            continue
        node, inside = nodes.pop()
        for a in node.attribute:
            label = f"{inside}node {_name(node)} attribute {a.name!r}"
            if a.HasField("t"):
                yield label, a.t, None
            for t in a.tensors:
                yield label, t, None
            for s in [a.sparse_tensor] if a.HasField("sparse_tensor") else []:
                yield label, s.values, s
            for s in a.sparse_tensors:
                yield label, s.values, s
            for g in [a.g] if a.HasField("g") else []:
                stack.append((g, f"{label}: "))
            for g in a.graphs:
                stack.append((g, f"{label}: "))


def _shape_words(tensor: Any, sparse: Any = None) -> str:
    """A tensor's dims and type in words (dims [..], FLOAT); of a sparse tensor's values, its dense dims."""
    import onnx

    return f"dims {list((sparse or tensor).dims)}, {onnx.TensorProto.DataType.Name(tensor.data_type)}"


def _checked_bytes(label: str, tensor: Any, sparse: Any, base_dir: str, where: str) -> int:
    """The bytes a tensor claims, once its data type is one onnx defines, its dims are not negative and
    its data holds what they claim (else UsageError naming it); for a sparse tensor's values, the dense
    tensor's bytes (runtimes make it dense)."""
    import onnx

    kind = onnx.TensorProto.DataType.Name(tensor.data_type) \
        if tensor.data_type in onnx.TensorProto.DataType.values() else "UNDEFINED"  # fmt: skip
    if kind == "UNDEFINED":
        raise UsageError(f"{where}{label}: data type {tensor.data_type} is not one onnx {onnx.__version__} defines: refused")
    for owner in (tensor, sparse) if sparse is not None else (tensor,):
        if any(d < 0 for d in owner.dims):
            raise UsageError(f"{where}{label}: dims {list(owner.dims)} (a negative dim): refused")
    n = math.prod(tensor.dims)
    entries = {e.key: e.value for e in tensor.external_data}
    if tensor.data_location == onnx.TensorProto.EXTERNAL or entries:  # check_external_data: inside the folder
        want, unit = tensor_bytes(tensor), "bytes"
        offset = int(entries.get("offset") or 0)
        if entries.get("length"):
            held, words, enough = int(entries["length"]), f"its external data's length is {entries['length']}", False
        else:  # the runtime reads the bytes its dims claim from the offset on
            held = os.path.getsize(os.path.join(base_dir, entries["location"])) - offset
            words, enough = f"{entries['location']!r} holds {held} past offset {offset}", True
    elif tensor.HasField("raw_data"):
        want, unit, enough = tensor_bytes(tensor), "bytes", False
        held, words = len(tensor.raw_data), f"its raw_data holds {len(tensor.raw_data)}"
    else:  # typed fields: one entry an element, two a complex one, 4- and 2-bit values packed in an entry
        field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
        want = 2 * n if kind.startswith("COMPLEX") else -(-n // _PER_ENTRY.get(kind, 1))
        unit, enough = f"{field} values", False
        held, words = len(getattr(tensor, field)), f"it holds {len(getattr(tensor, field))}"
    if held < want or (held > want and not enough):
        raise UsageError(f"{where}{label} ({_shape_words(tensor)}) claims {want} {unit}, and {words}: refused")
    return _claimed(tensor, sparse)


def _claimed(tensor: Any, sparse: Any) -> int:
    """The bytes a tensor claims; for a sparse tensor's values, the dense tensor's (runtimes make it dense)."""
    import onnx

    if sparse is None:
        return tensor_bytes(tensor)
    return tensor_bytes(onnx.TensorProto(dims=sparse.dims, data_type=tensor.data_type))


def _memory_limit(max_mem_gb: float | None) -> tuple[int | None, str]:
    if max_mem_gb is not None:
        if not max_mem_gb > 0:
            raise UsageError(f"--max-mem-gb must be positive, got {max_mem_gb}")
        return int(max_mem_gb * GB), "allowed by --max-mem-gb"
    return available_memory_bytes(), "available on this machine"


def _check_fits(what: str, claimed: int, limit: int | None, source: str, where: str, verb: str = "claims") -> None:
    if limit is not None and claimed > limit:
        raise ResourceError(f"{where}{what} {verb} {claimed} bytes ({claimed / GB:.1f} GB), more than the {limit} "
                            f"bytes ({limit / GB:.1f} GB) {source}: refused before allocating it")  # fmt: skip


def _constant_of_shape_bytes(node: Any, constants: dict[str, Any], base_dir: str) -> tuple[int, list[int]] | None:
    """(bytes, shape) of a ConstantOfShape's output when its shape is a constant of the graph (an
    initializer or a Constant node, at most _SHAPE_VALUES values, already checked), else None."""
    import onnx
    from onnx import numpy_helper

    source = constants.get(node.input[0]) if node.input else None
    if source is None:
        return None
    if isinstance(source, onnx.NodeProto):
        attr = next((a for a in source.attribute if a.name in ("value", "value_ints")), None)
        if attr is None:
            return None
        if attr.name == "value_ints":
            shape = list(attr.ints)
        elif math.prod(attr.t.dims) <= _SHAPE_VALUES:
            shape = [int(v) for v in numpy_helper.to_array(attr.t, base_dir).reshape(-1)]
        else:
            return None
    elif math.prod(source.dims) <= _SHAPE_VALUES:
        shape = [int(v) for v in numpy_helper.to_array(source, base_dir).reshape(-1)]
    else:
        return None
    if any(d < 0 for d in shape):
        return None  # not a shape: the runtime refuses it
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    out = onnx.TensorProto(dims=shape, data_type=value.data_type if value is not None else onnx.TensorProto.FLOAT)
    return tensor_bytes(out), shape
