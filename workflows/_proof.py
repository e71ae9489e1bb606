"""A proof of a whole model's rewrite (attnx optimize) or of its buffer form (attnx build --model) as a result object,
as Polygraphy's comparator and onnxscript's MatchResult return one: its status (code branches on it, never on the
text: bool() is False for a failure alone), what it proves, how that came out, and the statistics of the comparison
it rests on. str() is the line the report prints; a failed comparison's line ends with the atol that would have
passed where the detail does not say it already."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

from attnx.runtimes.compare import Comparison

__all__ = ["Proof", "ProofStats", "ProofStatus"]


class ProofStatus(enum.Enum):
    """What kind of outcome a proof is; its value is the word its line starts with."""

    PASS = "pass"
    FAIL = "FAIL"
    NOT_COMPARED = "not compared"  # not applicable: what it would prove is held otherwise, said how
    NOT_CHECKED = "not checked"  # what this version does not check: said, not failed
    NOT_READ = "not read"  # a block the reader could not read: kept as it is, with the reason
    SAID = "said"  # a fact the proofs rest on: how the input was quantized, a run held to another


@dataclasses.dataclass(frozen=True)
class ProofStats:
    """The numbers of the comparison a proof rests on (attnx.runtimes.compare; the worst where it rests on several),
    each None where it is not finite (a NaN compared, a run that failed)."""

    max_abs: float | None
    atol: float | None  # the bound it was held to: |out - ref| <= atol + rtol * |ref|
    rtol: float | None
    needed_atol: float | None  # the smallest atol that passes at this rtol
    cosine: float | None
    rel_rms: float | None

    @classmethod
    def of(cls, cmp: Comparison) -> ProofStats:
        return cls.from_stats({**cmp.stats(), "atol": cmp.atol, "rtol": cmp.rtol})

    @classmethod
    def from_stats(cls, stats: Mapping[str, float | None]) -> ProofStats:
        """From Comparison.stats() with its atol and rtol (a package Check's stats); a number it lacks is None."""
        return cls(*(_finite(stats.get(f.name)) for f in dataclasses.fields(cls)))

    @property
    def missed(self) -> bool:
        """Whether the comparison missed its bound: the atol it needed is past the one it was held to."""
        return self.needed_atol is not None and self.atol is not None and self.needed_atol > self.atol


@dataclasses.dataclass(frozen=True)
class Proof:
    """One proof: `subject` what it proves (or says), `detail` how it came out (the comparison's numbers, the
    findings, the reason), `stats` the comparison it rests on. `quoted`: the detail quotes the comparison
    (Comparison.detail(), which says the atol a failing one would need), so str() does not say it twice."""

    status: ProofStatus
    subject: str
    detail: str = ""
    stats: ProofStats | None = None
    quoted: bool = False

    @classmethod
    def verdict(cls, passed: bool, subject: str, detail: str = "", stats: ProofStats | None = None,
                quoted: bool = False) -> Proof:  # fmt: skip
        """A pass or a failure."""
        return cls(ProofStatus.PASS if passed else ProofStatus.FAIL, subject, detail, stats, quoted)

    def __bool__(self) -> bool:
        return self.status is not ProofStatus.FAIL

    @property
    def needed_atol(self) -> float | None:
        """The atol at which a failed comparison would have passed; None where it held its bound (or compared none)."""
        return self.stats.needed_atol if self.stats is not None and self.stats.missed else None

    def __str__(self) -> str:
        line = f"{self.status.value}: {self.subject}" + (f": {self.detail}" if self.detail else "")
        needed = self.needed_atol
        if self.status is ProofStatus.FAIL and needed is not None and not self.quoted:  # as Polygraphy's comparator
            line += f"; would pass at atol={needed:.3g}"
        return line

    def to_dict(self) -> dict[str, Any]:
        """For a --json report: the status ("pass", "fail", "not_compared", "not_checked", "not_read", "said"), the
        subject, the detail, the line as printed and the statistics (None where nothing was compared)."""
        return {"status": self.status.name.lower(), "subject": self.subject, "detail": self.detail, "line": str(self),
                "stats": dataclasses.asdict(self.stats) if self.stats is not None else None}  # fmt: skip


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None
