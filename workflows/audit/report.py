"""The audit's verdicts: one block's (BlockAudit) and the whole model's (AuditReport), with what was proven, what
could not run (a gap: `not_checked`) and what the model's dims rule out (`not_applicable`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnx.runtimes.compare import Comparison

__all__ = ["AuditReport", "BlockAudit"]


@dataclasses.dataclass
class BlockAudit:
    """One block's audit. Its verdict says what was proven: it passes when at least one check ran and every check
    run agrees, with no finding; a check its model cannot run (`not_checked`: why, and what the model then cannot
    serve) is a gap, named on its own line, that fails the block only under `strict`. A check the model's own dims
    rule out (a batch fixed at 1 has no padded batch) is neither: AuditReport.not_applicable names it."""

    index: int
    node: str
    core: str  # the registry's name of its core (attnx.model.cores)
    layer: int | None  # the checkpoint's layer it pairs with
    terms: tuple[str, ...]
    findings: list[str]
    checks: list[Comparison]
    not_checked: list[str]
    source: str = "checkpoint layer"  # what it is held to: a checkpoint's layer, or the attnx.config of attnx's model
    localised: str | None = None  # a failing block's first stage beyond its bound
    strict: bool = False  # a gap fails the block
    notes: list[str] = dataclasses.field(default_factory=list)  # why a check past the float rule passes

    @property
    def passed(self) -> bool:
        return bool(self.checks) and not self.findings and all(self.checks) and not (self.strict and self.not_checked)

    def worst(self) -> Comparison | None:
        return max(self.checks, key=lambda c: c.max_abs / max(c.atol, 1e-30), default=None)

    def line(self) -> str:
        verdict = "pass" if self.passed else "FAIL" if (self.findings or not all(self.checks)) else "not checked"
        worst = self.worst()
        err = f"max_abs {worst.max_abs:.3g} (atol {worst.atol:.3g})" if worst is not None else "not run"
        paired = "" if self.layer is None else f" = {self.source}" + (f" {self.layer}" if self.source != "attnx.config" else "")
        return f"block {self.index}{paired}: {verdict:<11} {err}  {self.core}  {','.join(self.terms)}  [{self.node}]"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "core": self.core, "layer": self.layer, "source": self.source,
                "terms": list(self.terms),
                "passed": self.passed, "findings": self.findings, "not_checked": self.not_checked,
                "localised": self.localised, "notes": self.notes,
                "checks": [{"name": c.name, "passed": c.passed, "atol": c.atol, "rtol": c.rtol, **c.stats()}
                           for c in self.checks]}  # fmt: skip


@dataclasses.dataclass
class AuditReport:
    """The audit of a whole model. It passes when every attention node was read into a block, every block passes
    (BlockAudit) and the whole model raised no finding; its gaps (a check some block, or the whole model's decoding,
    could not run) are listed, and fail it only under `strict`."""

    model: str
    checkpoint: str | None
    blocks: list[BlockAudit]
    unread: list[str]
    skipped: list[str] = dataclasses.field(default_factory=list)  # a backend unavailable on this machine, and why
    findings: list[str] = dataclasses.field(default_factory=list)  # of the whole model as exported
    others: list[str] = dataclasses.field(default_factory=list)  # Softmaxes not attention's (a router's), named
    not_checked: list[str] = dataclasses.field(default_factory=list)  # the whole model's gaps (its decoding)
    not_applicable: list[str] = dataclasses.field(default_factory=list)
    strict: bool = False

    @property
    def gaps(self) -> list[str]:
        """Every check that applies to the model and could not run: the blocks' and the whole model's."""
        return [line for b in self.blocks for line in b.not_checked] + self.not_checked

    @property
    def passed(self) -> bool:
        return (all(b.passed for b in self.blocks) and not self.unread and not self.findings
                and not (self.strict and self.not_checked))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "checkpoint": self.checkpoint, "passed": self.passed, "strict": self.strict,
                "blocks": [b.to_dict() for b in self.blocks], "unread": self.unread,
                "skipped": self.skipped, "findings": self.findings, "not_checked": self.not_checked,
                "not_applicable": self.not_applicable, "gaps": len(self.gaps), "others": self.others}  # fmt: skip
