"""What `attnx optimize` of a whole model says: per block its layer, its core before and after (or why it was kept), the
repairs made; the proofs; the verdict (stdout lines and the --json report)."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnx.workflows.rewrite.choose import CoreChoice, Timing

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
    choice: CoreChoice | None = None  # what was measured to choose its core (attnx.workflows.rewrite.choose)

    def time_lines(self) -> list[str]:
        """The block's times as the graph has it and in each core timed, ms: a prompt, a step, a request's cost."""
        c = self.choice
        if c is None or (c.before is None and not c.times):
            return []
        steps = c.shape["steps"]
        cells = [("as the graph has it", c.before)] + list(c.times.items())
        said = "; ".join(f"{name} {t.said()}" + (f" = {t.cost(steps):.4g} ms a request" if t.cost(steps) else "")
                         for name, t in cells if t is not None)  # fmt: skip
        return [f"  timed (prefill {c.shape['prefill']}, steps at past {c.shape['past']}, a request = prefill + "
                f"{steps} steps): {said}", f"  chosen: {c.reason}"]  # fmt: skip


@dataclasses.dataclass
class ModelOptimizeReport:
    model: str
    out: str
    checkpoint: str | None
    blocks: list[BlockRewrite]
    proofs: list[str]  # each proof, one line: "pass: ..." or "FAIL: ..."
    passed: bool = False
    written: bool = False
    provider: str = "cpu"
    # the whole model's times, before (the input) and after (the output), through its own inputs and outputs
    model_times: dict[str, Timing] = dataclasses.field(default_factory=dict)
    time_shape: dict[str, int] = dataclasses.field(default_factory=dict)

    def lines(self) -> list[str]:
        out = []
        for b in self.blocks:
            layer = f" = layer {b.layer}" if b.layer is not None else ""
            what = f"{b.core} -> {b.written}" if b.written else f"{b.core} kept: {b.kept}"
            out.append(f"block {b.index}{layer}: {what}  [{b.node}]")
            out += [f"  repair: {r}" for r in b.repairs]
            out += b.time_lines()
        out += self.proofs
        if self.model_times:
            shape = self.time_shape
            out.append(f"the whole model on {self.provider} (prefill {shape['prefill']}, a step at past {shape['past']}): "
                       + "; ".join(f"{k} {t.said()}" for k, t in self.model_times.items()))  # fmt: skip
        verdict = "wrote " + self.out if self.written else "nothing written"
        out.append(f"optimize {'PASSED' if self.passed else 'FAILED'}: {sum(b.written is not None for b in self.blocks)}"
                   f" of {len(self.blocks)} block(s) rewritten; {verdict}")  # fmt: skip
        return out

    def to_dict(self) -> dict[str, Any]:
        blocks = []
        for b in self.blocks:
            row = {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if f.name != "choice"}
            blocks.append({**row, "choice": b.choice.to_dict() if b.choice is not None else None})
        return {"model": self.model, "out": self.out, "checkpoint": self.checkpoint, "passed": self.passed,
                "written": self.written, "provider": self.provider, "blocks": blocks, "proofs": self.proofs,
                "time_shape": self.time_shape,
                "model_times": {k: dataclasses.asdict(t) for k, t in self.model_times.items()}}  # fmt: skip
