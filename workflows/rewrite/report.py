"""What `attnx optimize` of a whole model says: per block its layer, its core before and after (or why it was kept), the
repairs made; the proofs; the verdict (stdout lines and the --json report)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["BlockRewrite", "ModelOptimizeReport"]


@dataclasses.dataclass
class BlockRewrite:
    """One block: its layer, its core before and after (None: kept, with the reason), the repairs made."""

    index: int
    node: str
    core: str
    layer: int | None = None
    written: str | None = None
    kept: str | None = None
    repairs: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ModelOptimizeReport:
    model: str
    out: str
    checkpoint: str | None
    blocks: list[BlockRewrite]
    proofs: list[str]  # each proof, one line: "pass: ..." or "FAIL: ..."
    passed: bool = False
    written: bool = False

    def lines(self) -> list[str]:
        out = []
        for b in self.blocks:
            layer = f" = layer {b.layer}" if b.layer is not None else ""
            what = f"{b.core} -> {b.written}" if b.written else f"{b.core} kept: {b.kept}"
            out.append(f"block {b.index}{layer}: {what}  [{b.node}]")
            out += [f"  repair: {r}" for r in b.repairs]
        out += self.proofs
        verdict = "wrote " + self.out if self.written else "nothing written"
        out.append(f"optimize {'PASSED' if self.passed else 'FAILED'}: {sum(b.written is not None for b in self.blocks)}"
                   f" of {len(self.blocks)} block(s) rewritten; {verdict}")  # fmt: skip
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "out": self.out, "checkpoint": self.checkpoint, "passed": self.passed,
                "written": self.written, "blocks": [dataclasses.asdict(b) for b in self.blocks],
                "proofs": self.proofs}  # fmt: skip
