"""What `attnx optimize` of a whole model says: per block its layer, its core before and after (or why it was kept), the
repairs made; the proofs; the verdict (stdout lines and the --json report)."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnx._text import format_table
from attnx.model.terms import TERMS
from attnx.workflows._proof import Proof
from attnx.workflows.rewrite.choose import CoreChoice, Timing

__all__ = ["BlockRewrite", "ModelOptimizeReport", "formula_said"]


def _moved(before: Timing | None, after: Timing | None, field: str) -> str:
    """'old -> new' of one of two timings' fields, each '-' where not timed (with its error in the JSON)."""
    values = [getattr(t, field) if t is not None and t.error is None else None for t in (before, after)]
    return " -> ".join(_ms(v) for v in values)


@dataclasses.dataclass
class BlockRewrite:
    """One block: its layer, its core before and after (None: kept, with the reason), the repairs made (each
    difference from its checkpoint layer, the audit's finding; where the block is kept, not made)."""

    index: int
    node: str
    core: str
    layer: int | None = None
    written: str | None = None
    kept: str | None = None
    repairs: list[str] = dataclasses.field(default_factory=list)
    choice: CoreChoice | None = None  # what was measured to choose its core (attnx.workflows.rewrite.choose)
    config: dict[str, Any] | None = None  # the config it is written from (the graph's, or its checkpoint layer's)
    splice: str | None = None  # what is written: the whole block, or the core alone at the graph's projections
    formula: str | None = None  # without a checkpoint: the graph's own formula, as read, which it keeps

    def row(self) -> list[Any]:
        """Its row of the report's table: block, layer, the graph's core, what it is written as, and its prompt and
        step times as the graph has it -> as written (ms)."""
        c = self.choice
        after = c.times.get(self.written) if c is not None and self.written else None
        before = c.before if c is not None else None

        def moved(field: str) -> str | None:
            old, new = (getattr(t, field) if t is not None and t.error is None else None for t in (before, after))
            if old is None and new is None:
                return None
            return f"{_ms(old)} -> {_ms(new)}" if self.written else _ms(old)

        return [self.index, self.layer, self.core, self.written or "kept", moved("prefill_ms"), moved("step_ms")]

    def notes(self) -> list[str]:
        """What the table does not hold: why it was kept or chosen (each core's cost), its repairs."""
        fastest = self.choice is not None and self.choice.fastest
        out = [f"block {self.index} kept{' as the fastest' if fastest else ''}: {self.kept}"] if self.written is None else []
        if self.formula is not None:  # no checkpoint: what it computes is the graph's, never fixed on a guess
            out.append(f"block {self.index} formula: the graph's own, {self.formula}")
        c = self.choice
        if c is not None and (c.before is not None or c.times):
            steps = c.shape["steps"]
            cells = [("the graph's", c.before)] + list(c.times.items())
            said = ", ".join(f"{name} {t.cost(steps):.4g}" if t.cost(steps) is not None else f"{name} {t.said()}"
                             for name, t in cells if t is not None)  # fmt: skip
            head = c.head if self.written is not None else "timed"
            out.append(f"block {self.index}: {head}; a request (ms): {said}")
        if self.written is None:  # kept: what the checkpoint states otherwise stays as the graph has it
            return out + [f"block {self.index} not repaired: {r}" for r in self.repairs]
        return out + [f"block {self.index} repair: {r}: written as the checkpoint states" for r in self.repairs]


def formula_said(config: Any) -> str:
    """A config's formula in one line: its heads, its scale and each term it uses with its values (a term it does
    not use is not said: no softcap, no window)."""
    said = [f"{config.n_heads} heads over {config.n_kv_heads}" if config.n_kv_heads != config.n_heads
            else f"{config.n_heads} heads", f"head_dim {config.head_dim}", f"scale {config.softmax_scale:.4g}"]  # fmt: skip
    said += [line for line in (TERMS[name].said(config) for name in config.terms) if line is not None]
    return "; ".join(said)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


@dataclasses.dataclass
class ModelOptimizeReport:
    model: str
    out: str
    checkpoint: str | None
    blocks: list[BlockRewrite]
    proofs: list[Proof]  # each proof (attnx.workflows._proof), printed as one line: "pass: ..." or "FAIL: ..."
    passed: bool = False
    written: bool = False
    provider: str = "cpu"
    padding: str = "left"  # how the model's blocks read a padded batch: left (attention_mask), right (lengths)
    # the whole model's times, before (the input) and after (the output), through its own inputs and outputs
    model_times: dict[str, Timing] = dataclasses.field(default_factory=dict)
    time_shape: dict[str, int] = dataclasses.field(default_factory=dict)
    # each cache input as its block reads it: [kv heads, capacity, head_dim] (capacity: what a ring buffer holds
    # before the first token), for what the model's dims leave unnamed (the GenAI builder's kv_cache_dim)
    caches: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # --weights: what was quantized (attnx.export.passes.quantize_weights.WeightsRecord) and, once written, the
    # distance of the written model from the fp32 input (attnx.workflows.rewrite.weights)
    weights: dict[str, Any] | None = None
    # what the form served is written from (optimize_model's serve=True; attnx.workflows.rewrite.serve): the model as
    # it came, and the plans of the blocks written, their cores chosen. Not a report's field: never serialized
    served: tuple[Any, list[Any]] | None = dataclasses.field(default=None, repr=False, compare=False)

    def caches_read(self) -> dict[str, tuple[int, int, int]]:
        return {name: (kv, capacity, size) for name, (kv, capacity, size) in self.caches.items()}

    def lines(self) -> list[str]:
        """The report as printed: a table of the blocks, the notes of each (why kept or chosen, repairs), the proofs,
        the whole model's times and the verdict."""
        out = []
        if self.blocks:
            shape = next((b.choice.shape for b in self.blocks if b.choice is not None), None)
            prompt, step = ("prefill ms", "step ms") if shape is None else (
                f"prefill {shape['prefill']} ms", f"step ms (past {shape['past']})")  # fmt: skip
            table = format_table(["block", "layer", "graph's core", "written as", prompt, step],
                                 [b.row() for b in self.blocks])  # fmt: skip
            out += table.splitlines()
            if shape is not None:
                out.append(f"(times on {self.provider}, batch 1, the graph's block -> as written; a request: the "
                           f"prompt and {shape['steps']} steps)")  # fmt: skip
            for b in self.blocks:
                out += b.notes()
        out += [str(p) for p in self.proofs]
        if self.model_times:
            shape = self.time_shape
            before, after = self.model_times.get("before"), self.model_times.get("after")
            out.append(f"the whole model on {self.provider}: prefill {shape['prefill']} "
                       f"{_moved(before, after, 'prefill_ms')} ms, a step at past {shape['past']} "
                       f"{_moved(before, after, 'step_ms')} ms")  # fmt: skip
            out += [f"the whole model {when} not timed at that shape: {t.error}"
                    for when, t in (("before", before), ("after", after)) if t is not None and t.error is not None]
        verdict = "wrote " + self.out if self.written else "nothing written"
        fastest = sum(b.written is None and b.choice is not None and b.choice.fastest for b in self.blocks)
        kept = f", {fastest} kept as the fastest" if fastest else ""
        out.append(f"optimize {'PASSED' if self.passed else 'FAILED'}: {sum(b.written is not None for b in self.blocks)}"
                   f" of {len(self.blocks)} block(s) rewritten{kept}; {verdict}")  # fmt: skip
        return out

    def to_dict(self) -> dict[str, Any]:
        blocks = []
        for b in self.blocks:
            row = {f.name: getattr(b, f.name) for f in dataclasses.fields(b) if f.name != "choice"}
            blocks.append({**row, "choice": b.choice.to_dict() if b.choice is not None else None})
        return {"model": self.model, "out": self.out, "checkpoint": self.checkpoint, "passed": self.passed,
                "written": self.written, "provider": self.provider, "padding": self.padding, "blocks": blocks,
                "proofs": [str(p) for p in self.proofs], "proof_results": [p.to_dict() for p in self.proofs],
                "time_shape": self.time_shape, "caches": self.caches, "weights": self.weights,
                "model_times": {k: dataclasses.asdict(t) for k, t in self.model_times.items()}}  # fmt: skip
