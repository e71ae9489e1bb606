"""What every attnx graph pass shares: notes for the report, and the pipeline runner.

A pass is an onnx-ir pass (`call(model) -> PassResult(model, modified)`) that also keeps a
list of notes, one readable line per thing it changed or refused to change. The pipeline
is a plain list of passes; running it records, per pass, the node count before and after
and the notes, so `attnx optimize` and `attnx export` can print what each pass did.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from attnx.model.contract import MS_DOMAIN, op_counts

__all__ = ["AttnxPass", "PassRecord", "PipelineReport", "run_pipeline", "count_ops", "const_array", "fresh_name",
           "matmul_weight"]

logger = logging.getLogger(__name__)


class AttnxPass(ir.passes.InPlacePass):
    """An in-place onnx-ir pass that says what it did.

    Subclasses implement `call` and append to `self.notes`; notes are cleared at the start
    of every run so one pass object can be reused on several models.
    """

    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, model_or_result):  # type: ignore[override]
        self.notes = []
        return super().__call__(model_or_result)


@dataclasses.dataclass
class PassRecord:
    """One pass of one pipeline run."""

    name: str
    modified: bool
    nodes_before: int
    nodes_after: int
    notes: list[str]

    def lines(self) -> list[str]:
        head = (
            f"{self.name}: {'changed' if self.modified else 'unchanged'} "
            f"(nodes {self.nodes_before} -> {self.nodes_after})"
        )
        return [head] + [f"  {note}" for note in self.notes]


@dataclasses.dataclass
class PipelineReport:
    """What a pipeline did to a model, pass by pass."""

    records: list[PassRecord] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: dict[str, int] = dataclasses.field(default_factory=dict)
    ops_after: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def modified(self) -> bool:
        return any(r.modified for r in self.records)

    def fused_ops(self) -> dict[str, int]:
        """Operators of the com.microsoft domain in the result, with their counts."""
        return {op: n for op, n in self.ops_after.items() if op.startswith(f"{MS_DOMAIN}.")}

    def lines(self) -> list[str]:
        out: list[str] = []
        for record in self.records:
            out += record.lines()
        return out


def count_ops(model: ir.Model) -> dict[str, int]:
    """{op: count} over the main graph; ops outside the default domain are 'domain.Op'."""
    return op_counts(model.graph)


def run_pipeline(model: ir.Model, passes: Sequence[ir.passes.PassBase]) -> tuple[ir.Model, PipelineReport]:
    """Run `passes` in order on `model` (in place) and report each one."""
    report = PipelineReport(nodes_before=len(model.graph), ops_before=count_ops(model))
    for p in passes:
        before = len(model.graph)
        result = p(model)
        model = result.model
        notes = list(getattr(p, "notes", []))
        name = getattr(p, "name", type(p).__name__)
        record = PassRecord(name, bool(result.modified), before, len(model.graph), notes)
        for line in record.lines():
            logger.info("%s", line)
        report.records.append(record)
    report.nodes_after = len(model.graph)
    report.ops_after = count_ops(model)
    return model, report


def matmul_weight(value: ir.Value | None) -> tuple[ir.TensorProtocol | None, bool]:
    """A MatMul's constant weight: its own tensor, or the tensor a Transpose(perm [1, 0]) of a constant reads (how
    torch.onnx writes a tied LM head), with whether it is transposed; (None, False) for an activation."""
    if value is None:
        return None, False
    if value.const_value is not None:
        return value.const_value, False
    node = value.producer()
    if node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx") \
            and node.inputs[0] is not None and node.inputs[0].const_value is not None \
            and len(node.inputs[0].shape or ()) == 2 and list(node.attributes.get_ints("perm", [1, 0])) == [1, 0]:  # fmt: skip
        return node.inputs[0].const_value, True
    return None, False


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value as a numpy array when it is an initializer or a Constant node's output."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    node = value.producer()
    if node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        attr = node.attributes.get("value")
        if attr is not None:
            return attr.as_tensor().numpy()
        for name in ("value_int", "value_float"):
            if name in node.attributes:
                return np.array(node.attributes[name].value)
        for name in ("value_ints", "value_floats"):
            if name in node.attributes:
                return np.array(list(node.attributes[name].value))
    return None


def fresh_name(base: str, used: set[str]) -> str:
    """`base`, or `base`_2, _3, ... when `used` has it (docs/reference/onnx-graph.md, "Names": unique); taken into `used`."""
    candidate, n = base, 1
    while candidate in used:
        n += 1
        candidate = f"{base}_{n}"
    used.add(candidate)
    return candidate
