"""attnx.export, the graph layer: torch -> ONNX with the contract's dynamic dims (the decomposed
form, traced from the torch module), every lowering written from the registry of cores
(build_model: attnx.model.cores says which core, its emitter writes it), the readers that read a
graph back (its cores, their config, its weights), and the graph passes of precision and names
(attnx.export.passes). Graph work only: it never creates an ONNX Runtime session (the checks that
run a model are attnx.workflows).
"""

from __future__ import annotations

from attnx.export._emit import (
    build_decomposed_model,
    build_model,
    build_step_model,
    graph_opset,
    half_precision,
    quantize_model,
    with_dtype,
)
from attnx.export._export import export_onnx, name_contract_dims, quiet, release_rewriter_state, save_model
from attnx.export._read import (
    CoreReading,
    core_of,
    lowering_of,
    qk_weights,
    read_cores,
    read_weights,
    v_weights,
)
from attnx.export.cores import GRAPH_CORES

__all__ = [
    "GRAPH_CORES",
    "CoreReading",
    "build_decomposed_model",
    "build_model",
    "build_step_model",
    "core_of",
    "export_onnx",
    "graph_opset",
    "half_precision",
    "lowering_of",
    "name_contract_dims",
    "qk_weights",
    "quantize_model",
    "quiet",
    "read_cores",
    "read_weights",
    "release_rewriter_state",
    "save_model",
    "v_weights",
    "with_dtype",
]
