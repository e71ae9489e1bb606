"""The graph half of each attention core (attnx.model.cores declares them): how it is written into a graph, how a
node of it is read back (what the node states of the config), and how a block around it is read from a graph
whoever wrote it. One entry a core, in one table:

    GRAPH_CORES[name]      CoreGraph(emit, read, read_block, claims, is_attention)
    core_of_node(node)     the core a node is: the declarations whose op and domain it has, told apart by claims()

Each core's module (attnx.export.cores.<core>) registers its entry; a new core is its declaration and one module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from attnx.model.cores import CORES

__all__ = ["CoreGraph", "GRAPH_CORES", "core_of_node", "register"]

_STD = ("", "ai.onnx")


@dataclasses.dataclass(frozen=True)
class CoreGraph:
    """One core's graph half (the module doc). emit(e) writes the core into e.g (an Emit) and returns z; read(node)
    gives what a node of it states ({config key: value}); read_block(index, node, keep_weights) reads the block
    around it (a Block: attnx.export.cores._block), None where the audit reads no such block; claims(node,
    graph_core) says whether a node of the declaration's op is this core (several cores share MultiHeadAttention);
    is_attention(node) whether such a node computes attention at all (the decomposed core's Softmax: one of q.k, not
    a router's or a classifier's)."""

    name: str
    emit: Callable[[Any], str]
    read: Callable[[ir.Node], dict[str, Any]] | None = None
    read_block: Callable[..., Any] | None = None
    claims: Callable[[ir.Node, str], bool] = lambda node, graph_core: True
    is_attention: Callable[[ir.Node], bool] = lambda node: True


GRAPH_CORES: dict[str, CoreGraph] = {}


def register(entry: CoreGraph) -> CoreGraph:
    """Add a core's graph half to GRAPH_CORES, under its declaration's name."""
    if entry.name not in CORES:
        raise ValueError(f"no core {entry.name!r} in the registry (attnx.model.cores)")
    GRAPH_CORES[entry.name] = entry
    return entry


def core_of_node(node: ir.Node, graph_core: str) -> str | None:
    """The registry's core a node is, given the core the graph holds: the declarations whose op and domain it has
    (Core.op_type, Core.node_domain) and whose reader claims it; None for a node of no core (the buffer form's auto If is
    read as its branches' cores; the growing form's is the auto core)."""
    domain = "" if node.domain in _STD else node.domain
    for name, core in CORES.items():
        entry = GRAPH_CORES.get(name)
        if core.op_type == node.op_type and core.node_domain == domain and entry is not None and entry.read is not None \
                and entry.claims(node, graph_core):  # fmt: skip
            return name
    return None


def present(node: ir.Node, index: int) -> bool:
    return len(node.inputs) > index and node.inputs[index] is not None


def float_attr(node: ir.Node, name: str) -> float | None:
    attr = node.attributes.get(name)
    return float(attr.value) if attr is not None else None


def int_attr(node: ir.Node, name: str, default: int | None = None) -> int | None:
    attr = node.attributes.get(name)
    return int(attr.value) if attr is not None else default
