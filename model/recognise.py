"""The one recogniser of attention cores in a graph: each core's entry (attnx.model.cores.Core.found: its op in its
domain, told apart by Core.tells) is asked of a node; nothing else tells a core by its nodes.

    recognise(seen)     the core a node is (and whether the node is read as it, or as the cores inside it)
    graph_core(nodes)   the core a whole graph holds: what describe() and the passes name its lowering by

A node is given as attnx.model.seen.Seen: seen_in(graph) reads an onnx GraphProto, attnx.export.cores.seen an
onnx-ir node.
"""

from __future__ import annotations

from collections.abc import Iterable

from attnx.model.cores import CORES
from attnx.model.seen import Found, Seen

__all__ = ["graph_core", "recognise"]


def recognise(seen: Seen) -> tuple[str | None, Found]:
    """The core a node is, and how (Found.NODE: the node is it; GRAPH: the graph holds it, the node read as the cores
    inside it): the entry whose op, domain and `tells` find it (at most one does), else (None, NO). The one
    recogniser: what describe(), the graph passes, the audit and optimize read a graph's cores by."""
    return next(((name, found) for name, core in CORES.items() if (found := core.found(seen)) is not Found.NO),
                (None, Found.NO))  # fmt: skip


def graph_core(nodes: Iterable[Seen]) -> str:
    """The core a graph holds, from its nodes (model.seen.seen_in; attnx.export.cores.seen_graph): the cores its
    outermost core nodes are (recognise; an If's branches are asked only where the If is no core), decomposed's
    Softmax aside (Core.fallback: it stays where a fused core was written, a router's, a classifier's); a graph of
    several is named by the first in the registry's order (mha before mha-packed: one MultiHeadAttention fed otherwise
    than by a Split is not the packed form); the fallback core where there is none."""
    found: set[str] = set()

    def walk(seens: Iterable[Seen]) -> None:
        for seen in seens:
            name, _ = recognise(seen)
            if name is None:
                walk(seen.branches)
            else:
                found.add(name)

    walk(nodes)
    fallback = next(name for name, core in CORES.items() if core.fallback)
    return next((name for name, core in CORES.items() if name in found and not core.fallback), fallback)

