"""attnx.export.cores: each attention core's graph half, one module a core (the registry: _registry.GRAPH_CORES)."""

from __future__ import annotations

from attnx.export.cores import attention23, auto, decomposed, gqa, grouped_mha, mha, ms_attention  # noqa: F401 (they register)
from attnx.export.cores._block import Block, Unread, UnreadKind
from attnx.export.cores._emit import Emit
from attnx.export.cores._registry import GRAPH_CORES, CoreGraph, core_of_graph, core_of_node, seen

__all__ = ["Block", "CoreGraph", "Emit", "GRAPH_CORES", "Unread", "UnreadKind", "core_of_graph", "core_of_node", "seen"]
