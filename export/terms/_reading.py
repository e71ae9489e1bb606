"""A block's reading of its terms, typed: what the cores' readers (attnx.export.cores) found of each term beside the
config, and what the audit adds by running what the graph computes (attnx.workflows.audit.cut.read_computed_terms).
Read by the terms' graph halves (GraphTerm.reading picks its part), the audit and optimize's plan. One field a term's
reading, never a dict of string keys; each reading is its term's own type (RopeReading in attnx.export.terms.rope,
MaskReading for the three mask terms)."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnx.export.terms._base import MaskReading
from attnx.export.terms.rope import RopeReading

__all__ = ["ComputedTerm", "Reading"]


@dataclasses.dataclass
class ComputedTerm:
    """A term whose values the graph computes per token rather than states (a temperature on q): the tensor the audit
    runs for a prompt, and how its values were read (its fit_values: "floor_scale 8, attn_scale 0.1", or why not;
    None: not run yet)."""

    tensor: str
    said: str | None = None


@dataclasses.dataclass
class Reading:
    """What a block's reading holds of its terms (the module doc).

    rope         the rotation: its tables, where the graph has or computes them, how they were fitted
    mask         how the mask the graph computes was read; the local_window_size a node states
    qk_norm_eps  q's and k's per-head norms' eps as the graph has them (the config keeps q's; None: no norms)
    computed     term name -> the tensor the graph computes its values in, run by the audit (ComputedTerm)"""

    rope: RopeReading = dataclasses.field(default_factory=RopeReading)
    mask: MaskReading = dataclasses.field(default_factory=MaskReading)
    qk_norm_eps: tuple[float, float] | None = None
    computed: dict[str, ComputedTerm] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The reading in JSON's types (the audit's --json)."""
        return {"rope": self.rope.to_dict(), "mask": dataclasses.asdict(self.mask),
                "qk_norm_eps": None if self.qk_norm_eps is None else list(self.qk_norm_eps),
                "computed": {name: dataclasses.asdict(term) for name, term in self.computed.items()}}  # fmt: skip
