"""The graph half of each attention core (attnx.model.cores declares them): how it is written into a graph, how a
node of it is read back (what the node states of the config), and how a block around it is read from a graph
whoever wrote it. One entry a core, in one table:

    GRAPH_CORES[name]      CoreGraph(emit, read, read_block, is_attention)
    core_of_node(node)     the core a node is, by the one recogniser (attnx.model.recognise, each core's Core.tells)
    core_of_graph(graph)   the core a graph holds, by the same

Each core's module (attnx.export.cores.<core>) registers its entry; a new core is its declaration and one module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from attnx.model.cores import CORES
from attnx.model.recognise import graph_core, recognise
from attnx.model.seen import ROWS_PERM, Found, Seen

__all__ = ["CoreGraph", "GRAPH_CORES", "core_of_graph", "core_of_node", "register", "seen"]

_STD = ("", "ai.onnx")


@dataclasses.dataclass(frozen=True)
class CoreGraph:
    """One core's graph half (the module doc). emit(e) writes the core into e.g (an Emit) and returns z; read(node)
    gives what a node of it states ({config key: value}); read_block(index, node, keep_weights) reads the block
    around it (a Block: attnx.export.cores._block), None where the audit reads no such block; is_attention(node) whether such a node computes attention at all (the decomposed core's Softmax: one of q.k, not
    a router's or a classifier's)."""

    name: str
    emit: Callable[[Any], str]
    read: Callable[[ir.Node], dict[str, Any]] | None = None
    read_block: Callable[..., Any] | None = None
    is_attention: Callable[[ir.Node], bool] = lambda node: True


GRAPH_CORES: dict[str, CoreGraph] = {}


def register(entry: CoreGraph) -> CoreGraph:
    """Add a core's graph half to GRAPH_CORES, under its declaration's name."""
    if entry.name not in CORES:
        raise ValueError(f"no core {entry.name!r} in the registry (attnx.model.cores)")
    GRAPH_CORES[entry.name] = entry
    return entry


def seen(node: ir.Node) -> Seen:
    """An onnx-ir node as the recogniser sees it (attnx.model.seen.Seen; seen_in reads a GraphProto the same way)."""
    first = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    moved = first.inputs[0].producer() if first is not None and first.op_type == "Reshape" and first.inputs \
        and first.inputs[0] is not None else None  # fmt: skip
    rows = moved is not None and moved.op_type == "Transpose" \
        and tuple(moved.attributes.get_ints("perm", [])) == ROWS_PERM  # fmt: skip
    branches = tuple(seen(n) for a in node.attributes.values() if a.type == ir.AttributeType.GRAPH for n in a.value)
    return Seen("" if node.domain in _STD else node.domain, node.op_type, first.op_type if first is not None else None,
                tuple(value is not None for value in node.inputs), rows, branches)  # fmt: skip


def core_of_node(node: ir.Node) -> str | None:
    """The registry's core a node is (attnx.model.recognise.recognise); None for a node of no core, and for one read
    as the cores inside it (the buffer form's switch If: its branches' cores; the growing form's is the switch core)."""
    name, found = recognise(seen(node))
    return name if found is Found.NODE else None


def core_of_graph(graph: ir.Graph) -> str:
    """The registry's core a graph holds (attnx.model.recognise.graph_core)."""
    return graph_core(seen(node) for node in graph)


def present(node: ir.Node, index: int) -> bool:
    return len(node.inputs) > index and node.inputs[index] is not None


def float_attr(node: ir.Node, name: str) -> float | None:
    attr = node.attributes.get(name)
    return float(attr.value) if attr is not None else None


def int_attr(node: ir.Node, name: str, default: int | None = None) -> int | None:
    attr = node.attributes.get(name)
    return int(attr.value) if attr is not None else default
