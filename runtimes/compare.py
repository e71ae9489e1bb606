"""The comparator: how an output compares with its reference, under the tolerance table.

Every number a report gives about agreement comes from here: parity (attnx parity and the
build's parity), export validation against torch, optimize's parity against the model it
lowered, auto's parity gate, package verify and the GPU check. The tolerance itself (the rule
and its table) is attnx.model.tolerance; this module applies it:

    |out - ref| <= atol + rtol * |ref|  everywhere, computed in float64

and reports max/mean/p99 absolute error, max relative error, cosine similarity and the atol
that would have been needed. A Comparison is true when it passes; str() says by how much.

Only the positions that count enter it (`where`: a padded batch's padding positions, whose outputs have no
meaning, are left out of the verdict and of every number), and a NaN or inf at one of them, in the output or
the reference, fails it, its first position named.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from attnx.model.tolerance import ProblemSize, Tolerance

__all__ = ["Comparison", "compare_arrays", "failed_run", "case_label"]


def case_label(batch: int, seq: int, mem_seq: int | None, output: str = "y") -> str:
    """How a checked output is named in reports: y[batch=3,seq=17(,mem_seq=1)]."""
    return f"{output}[batch={batch},seq={seq}{f',mem_seq={mem_seq}' if mem_seq else ''}]"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """How one output compares with its reference. bool() is pass/fail; str() says the
    tolerance that would have been needed."""

    name: str
    passed: bool
    max_abs: float
    mean_abs: float
    p99_abs: float
    max_rel: float
    cosine: float
    atol: float
    rtol: float
    needed_atol: float  # the smallest atol that passes with this rtol
    shape_error: str | None = None
    rel_rms: float = float("nan")  # ||out - ref|| / ||ref||: the frontier's accuracy axis
    rel_rms_bound: float | None = None  # a quantized form's error model bounds it too (tolerance)
    nonfinite: tuple[int, ...] | None = None  # the first counted position holding a NaN or inf (compare_arrays)
    nonfinite_in: str | None = None  # whose value it is there: "output" or "reference"

    def __bool__(self) -> bool:
        return self.passed

    def stats(self) -> dict[str, float | None]:
        """The error statistics as JSON numbers (None where not finite: a failed run)."""
        keys = ("max_abs", "max_rel", "mean_abs", "p99_abs", "cosine", "needed_atol", "rel_rms")
        return {k: _finite(getattr(self, k)) for k in keys}

    def detail(self) -> str:
        """One line without the name: the error against the tolerance (and, when it fails,
        the atol that would have passed), or why nothing could be compared."""
        if self.shape_error:
            return self.shape_error
        need = "" if self.passed else f"; would need atol>={self.needed_atol:.3g}"
        return (
            f"max_abs={self.max_abs:.3g} (atol={self.atol:.3g}, rtol={self.rtol:.3g}{need}) cos={self.cosine:.9f}"
            + self._rms_text()
            + self._nonfinite_text()
        )

    def _nonfinite_text(self) -> str:
        if self.nonfinite is None:
            return ""
        return f"; the {self.nonfinite_in} is not finite at [{', '.join(map(str, self.nonfinite))}]"

    def _rms_text(self) -> str:
        if self.rel_rms_bound is None:
            return f" rel_rms={self.rel_rms:.3g}"
        return f" rel_rms={self.rel_rms:.3g} (bound {self.rel_rms_bound:.3g})"

    def __str__(self) -> str:
        if self.shape_error:
            return f"{self.name}: {self.shape_error}"
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{self.name}: {verdict} max_abs={self.max_abs:.3g} (atol={self.atol:.3g}, rtol={self.rtol:.3g}; "
            f"would need atol>={self.needed_atol:.3g}) max_rel={self.max_rel:.3g} cos={self.cosine:.9f}"
            + self._rms_text()
            + self._nonfinite_text()
        )


def compare_arrays(name: str, out: np.ndarray, ref: np.ndarray, tol: Tolerance, size: ProblemSize,
                   scale: float | None = None, p99: bool = True, where: np.ndarray | None = None) -> Comparison:  # fmt: skip
    """Compare `out` with `ref` under the tolerance rule above (in float64). scale: what the atol is
    relative to where it is not rms(ref), and a quantized form's share of every row where it is not
    the row's RMS (a stage's own, attnx.model.tolerance.stage_tolerance). p99=False: no 99th
    percentile (nan; a partial sort of every error, what localisation's many comparisons skip).
    where: the positions that count, a bool array over the leading dims of both (a padded batch's
    attention_mask != 0, [batch, seq] of logits [batch, seq, vocab]); the others enter no number. A NaN
    or inf at a counted position, in either, fails the comparison and is named (Comparison.nonfinite:
    its index over `where`'s dims, or over all but the last dim)."""
    differs = tuple(out.shape) != tuple(ref.shape)
    if differs or (where is not None and tuple(out.shape[: np.ndim(where)]) != np.shape(where)):
        nan = float("nan")
        said = (f"shape {list(out.shape)} differs from the reference's {list(ref.shape)}" if differs
                else f"shape {list(out.shape)} does not start with its positions' {list(np.shape(where))}")  # fmt: skip
        return Comparison(name, False, nan, nan, nan, nan, nan, 0.0, tol.rtol, nan, shape_error=said)
    where = None if where is None else np.asarray(where, bool)
    bad_at, bad_in = _first_nonfinite(np.asarray(out), np.asarray(ref), where)
    o = np.asarray(out if where is None else np.asarray(out)[where], dtype=np.float64)
    r = np.asarray(ref if where is None else np.asarray(ref)[where], dtype=np.float64)
    finite = bad_at is None
    given_scale = scale is not None
    if scale is None:  # the reference's finite values (one that is not finite fails the comparison whatever the atol)
        rf = r if finite else r[np.isfinite(r)]
        scale = float(np.sqrt(np.mean(rf * rf))) if rf.size else 0.0
    atol = tol.atol(size, max(scale, np.finfo(np.float32).tiny))
    diff = np.abs(o - r)
    given = r
    if not finite:  # an infinite error there, against a bound of the reference's finite values
        diff = np.where(np.isfinite(o) & np.isfinite(r), diff, np.inf)
        r = np.where(np.isfinite(r), r, 0.0)
    bound = tol.rtol * np.abs(r)
    quantized = hasattr(tol, "quant_bound") and r.ndim > 0
    if quantized:  # a quantized form: its error model's share, row by row (attnx.model.tolerance)
        float_atol = Tolerance.atol(tol, size, max(scale, np.finfo(np.float32).tiny))
        # a given scale stands for every row (a stage whose error is not relative to its row: the scores)
        rows = np.asarray(scale) if given_scale else np.sqrt(np.mean(r * r, axis=-1, keepdims=True))
        bound = bound + float_atol + tol.quant_bound(size, rows)
        passed = finite and bool((diff <= bound).all())
        # reported: the bound at a row of RMS rms(ref), and that scaled by the worst ratio
        needed = atol * float(np.max(diff / np.maximum(bound, np.finfo(np.float64).tiny))) if diff.size else 0.0
    else:
        passed = finite and bool((diff <= atol + bound).all())
        needed = float(np.max(diff - bound)) if diff.size else 0.0
    rel = diff / np.maximum(np.abs(r), scale)  # relative to the value, floored at the RMS
    ref_norm = float(np.linalg.norm(r))
    rel_rms = float(np.linalg.norm(o - r) / ref_norm) if ref_norm > 0 and finite else (0.0 if finite else math.inf)
    rms_bound = (
        tol.rel_rms_bound(size, max(scale, np.finfo(np.float32).tiny), int(r.size))
        if hasattr(tol, "rel_rms_bound")
        else None
    )
    if rms_bound is not None and not rel_rms <= rms_bound:
        passed = False
    denom = float(np.linalg.norm(o) * np.linalg.norm(r))
    cosine = float(np.sum(o * r) / denom) if denom > 0 and finite else (1.0 if np.array_equal(o, given) else 0.0)
    return Comparison(
        name=name,
        passed=passed,
        max_abs=float(diff.max()) if diff.size else 0.0,
        mean_abs=float(diff.mean()) if diff.size else 0.0,
        p99_abs=_p99(diff) if p99 else float("nan"),
        max_rel=float(rel.max()) if rel.size else 0.0,
        cosine=cosine,
        atol=atol,
        rtol=tol.rtol,
        needed_atol=max(needed, 0.0),
        rel_rms=rel_rms,
        rel_rms_bound=rms_bound,
        nonfinite=bad_at,
        nonfinite_in=bad_in,
    )


def _first_nonfinite(out: np.ndarray, ref: np.ndarray,
                     where: np.ndarray | None) -> tuple[tuple[int, ...] | None, str | None]:  # fmt: skip
    """The first counted position (over `where`'s dims, else all but the last) where `out` or `ref` holds a NaN or
    an inf, and whose it is (the output's first where both are); (None, None) where every counted value is finite."""
    dims = where.ndim if where is not None else max(out.ndim - 1, min(out.ndim, 1))
    flags = []
    for a in (out, ref):
        bad = ~np.isfinite(a) if np.issubdtype(a.dtype, np.inexact) else np.zeros(a.shape, bool)
        bad = bad.reshape(bad.shape[:dims] + (-1,)).any(-1) if bad.ndim > dims else bad
        flags.append(bad if where is None else bad & where)
    either = flags[0] | flags[1]
    if not either.any():
        return None, None
    at = tuple(int(i) for i in np.argwhere(either)[0])
    return at, "output" if flags[0][at] else "reference"


def _p99(diff: np.ndarray) -> float:
    if not diff.size:
        return 0.0
    with np.errstate(invalid="ignore"):  # inf - inf between two infinite errors: the percentile is inf or nan
        return float(np.percentile(diff, 99))


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def failed_run(name: str, error: BaseException | str) -> Comparison:
    """A comparison that failed because the model did not run at all."""
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    nan = float("nan")
    return Comparison(name, False, nan, nan, nan, nan, nan, 0.0, 0.0, nan, shape_error=f"does not run: {text}")
