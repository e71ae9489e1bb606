"""A graph's node as the cores' recogniser sees it (attnx.model.cores.recognise), and how each core tells its node.

    Seen            one node: its op and domain, the op making its first input, which inputs are given, whether its
                    query is a group's heads as rows, an If's branches' nodes
    Found           what a core's entry says of a node: NO, NODE (the node is the core) or GRAPH (the graph holds
                    the core, the node read as the cores inside it: the buffer form's auto If)
    seen_in(graph)  the nodes of an onnx GraphProto as Seen (describe() reads the lowering by it); attnx.export
                    reads an onnx-ir node by attnx.export.cores.seen

Each core's entry (attnx.model.cores.Core.tells) says what tells its node from another core's of the same op; the
functions here are those tells, one a core that shares its op. No onnx import: a proto is read by its fields.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

__all__ = ["Found", "ROWS_PERM", "Seen", "seen_in", "tells_switch", "tells_grouped", "tells_mha", "tells_packed"]

_STD = ("", "ai.onnx")
_MS = "com.microsoft"
# [B, S, Hkv, G, hd] <-> [B, S, G, Hkv, hd]: a group's query heads after each token (the grouped core's query rows)
ROWS_PERM = (0, 1, 3, 2, 4)
_PAST_KEY, _PAST_SEQUENCE_LENGTH = 6, 8  # MultiHeadAttention's inputs: its own past, the shared cache's lengths


class Found(enum.Enum):
    NO = "no"
    NODE = "node"  # the node is the core: read it as one
    GRAPH = "graph"  # the graph holds the core; the node is read as the cores inside it


@dataclasses.dataclass(frozen=True)
class Seen:
    """One node of a graph, as much of it as tells the cores apart."""

    domain: str  # "" for the standard ops
    op_type: str
    fed_by: str | None = None  # the op of the node making its first input
    given: tuple[bool, ...] = ()  # which of its inputs are given (an optional one left out: False)
    rows: bool = False  # its first input a Reshape of a Transpose by ROWS_PERM (a group's query heads as rows)
    branches: tuple[Seen, ...] = ()  # the nodes of its subgraphs (an If's branches), one level down

    def has(self, index: int) -> bool:
        return len(self.given) > index and self.given[index]


def _grouped(seen: Seen) -> bool:
    """A MultiHeadAttention of the grouped core: its query a group's heads as rows, or it reads the shared cache."""
    return seen.rows or seen.has(_PAST_SEQUENCE_LENGTH)


def tells_grouped(seen: Seen) -> Found:
    return Found.NODE if _grouped(seen) else Found.NO


def tells_mha(seen: Seen) -> Found:
    """Separate q, k and v (mha): the query not rows, nor a Split's output."""
    return Found.NODE if not _grouped(seen) and seen.fed_by != "Split" else Found.NO


def tells_packed(seen: Seen) -> Found:
    """One q/k/v MatMul and a Split (mha-packed): the query a Split's output."""
    return Found.NODE if not _grouped(seen) and seen.fed_by == "Split" else Found.NO


def tells_switch(seen: Seen) -> Found:
    """An If whose branches hold GroupQueryAttention and the grouped MultiHeadAttention: the growing form's (the
    grouped branch over its own past/present) is read as the core; the buffer form's (the shared cache) as its
    branches' cores."""
    ops = {(b.domain, b.op_type): b for b in reversed(seen.branches)}  # the first of each op
    mha, gqa = ops.get((_MS, "MultiHeadAttention")), ops.get((_MS, "GroupQueryAttention"))
    if mha is None or gqa is None:
        return Found.NO
    own_past = _grouped(mha) and mha.has(_PAST_KEY) and not mha.has(_PAST_SEQUENCE_LENGTH)
    return Found.NODE if own_past else Found.GRAPH


def seen_in(graph: Any) -> list[Seen]:
    """The nodes of an onnx GraphProto (its subgraphs' under each node's Seen.branches), as Seen."""
    producers: dict[str, Any] = {}

    def collect(g: Any) -> None:
        for node in g.node:
            producers.update((out, node) for out in node.output if out)
            for sub in _subgraphs(node):
                collect(sub)

    def seen(node: Any) -> Seen:
        first = producers.get(node.input[0]) if node.input else None
        moved = producers.get(first.input[0]) if first is not None and first.op_type == "Reshape" else None
        perm = next((tuple(a.ints) for a in moved.attribute if a.name == "perm"), ()) if moved is not None else ()
        return Seen("" if node.domain in _STD else node.domain, node.op_type,
                    first.op_type if first is not None else None, tuple(bool(name) for name in node.input),
                    moved is not None and moved.op_type == "Transpose" and perm == ROWS_PERM,
                    tuple(seen(n) for sub in _subgraphs(node) for n in sub.node))  # fmt: skip

    collect(graph)
    return [seen(node) for node in graph.node]


def _subgraphs(node: Any) -> Iterable[Any]:
    for attr in node.attribute:
        yield from [attr.g] if attr.HasField("g") else attr.graphs
