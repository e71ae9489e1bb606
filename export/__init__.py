"""attnx.export, the graph layer: torch -> ONNX with the contract's dynamic dims, and the graph
passes that lower the attention core (attnx.export.passes). Graph work only: it never creates
an ONNX Runtime session (the checks that run a model are attnx.workflows).
"""

from __future__ import annotations

from attnx.export._export import (
    EXPORTED_LOWERINGS,
    export_onnx,
    name_contract_dims,
    quiet,
    release_rewriter_state,
    save_model,
)
from attnx.export._step import build_decomposed_model, build_full_model, build_step_model, graph_opset, half_precision

__all__ = [
    "build_decomposed_model",
    "build_full_model",
    "build_step_model",
    "EXPORTED_LOWERINGS",
    "export_onnx",
    "graph_opset",
    "half_precision",
    "name_contract_dims",
    "quiet",
    "release_rewriter_state",
    "save_model",
]
