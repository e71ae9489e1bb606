"""attnx.workflows: what combines the graph layer and the run layer.

Export with its validation at unseen shapes (export_model), the one optimizer of every model
(optimize_model: a model attnx wrote is a whole model with one block), the measured choice of
lowering (lower with attention="measure"), the
deployment package build (build_package), and the import of a model people have, checked
against its source (import_model), and the audit of a whole model another tool exported
(audit_model). Below: attnx.model, attnx.export, attnx.runtimes;
above: attnx.bench and the API/CLI.
"""

from __future__ import annotations

from attnx.runtimes.localise import set_decomposed_writer
from attnx.workflows._build import (
    DEFAULT_ATTENTION,
    DEFAULT_PROVIDERS,
    LARGE_MODEL_BYTES,
    BuildReport,
    CheckPlan,
    build_package,
    check_plan,
    parity_markdown,
    write_npz,
)
from attnx.workflows._build_model import ModelBuildReport, build_model_package
from attnx.workflows._checks import (
    PARITY_SHAPES,
    VALIDATION_SHAPES,
    Expected,
    check_against_expected,
    check_dims,
    check_model_file,
    compare_models,
    torch_expected,
    validate_against_torch,
)
from attnx.workflows._export import ExportReport, export_model, write_decomposed_form
from attnx.workflows._import import ImportReport, check_against_source, import_model
from attnx.workflows._lower import AUTO_CANDIDATES, AUTO_SHAPE, AutoChoice, choose_lowering, lower
from attnx.workflows._proof import Proof, ProofStats, ProofStatus
from attnx.workflows.audit import AuditReport, BlockAudit, audit_model
from attnx.workflows.audit.whole import WholeModel, open_whole_model
from attnx.workflows.rewrite import ModelOptimizeReport, optimize_model

set_decomposed_writer(write_decomposed_form)  # localisation's look inside a fused operator: the exporter's form

__all__ = [
    "ModelBuildReport",
    "build_model_package",
    "AUTO_CANDIDATES",
    "AUTO_SHAPE",
    "DEFAULT_ATTENTION",
    "DEFAULT_PROVIDERS",
    "LARGE_MODEL_BYTES",
    "PARITY_SHAPES",
    "VALIDATION_SHAPES",
    "AuditReport",
    "AutoChoice",
    "BlockAudit",
    "BuildReport",
    "CheckPlan",
    "Expected",
    "ExportReport",
    "ImportReport",
    "Proof",
    "ProofStats",
    "ProofStatus",
    "audit_model",
    "build_package",
    "check_against_expected",
    "check_against_source",
    "check_dims",
    "check_model_file",
    "check_plan",
    "choose_lowering",
    "compare_models",
    "export_model",
    "write_decomposed_form",
    "import_model",
    "lower",
    "optimize_model",
    "WholeModel",
    "open_whole_model",
    "ModelOptimizeReport",
    "parity_markdown",
    "torch_expected",
    "validate_against_torch",
    "write_npz",
]
