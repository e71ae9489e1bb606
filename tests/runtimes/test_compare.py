"""The one comparator (attnx.runtimes.compare): only the positions that count enter it (`where`: a padded batch's
padding positions have no meaning), and a NaN or inf at one of them, in the output or the reference, fails it with
its first position named."""

from __future__ import annotations

import numpy as np

from attnx.model.tolerance import ProblemSize, tolerance_for
from attnx.runtimes.compare import compare_arrays

TOL, SIZE = tolerance_for("fp32"), ProblemSize(64)


def _logits() -> tuple[np.ndarray, np.ndarray]:
    """Logits [batch 2, 6 positions, vocab 7] and the positions that count: row 1 left-padded by 2."""
    ref = np.random.default_rng(0).normal(size=(2, 6, 7)).astype(np.float32)
    keep = np.ones((2, 6), bool)
    keep[1, :2] = False
    return ref, keep


def test_a_nan_or_any_value_at_a_padding_position_enters_no_number():
    ref, keep = _logits()
    out = ref.copy()
    out[1, 0] = np.nan  # a padding position: what a row that sees no key gives
    out[1, 1] = 1e30
    padded = compare_arrays("logits", out, ref, TOL, SIZE, where=keep)
    same = compare_arrays("logits", ref[keep], ref[keep], TOL, SIZE)  # the real positions alone
    assert padded and padded.nonfinite is None, str(padded)
    assert (padded.max_abs, padded.atol, padded.cosine, padded.rel_rms) == (0.0, same.atol, same.cosine, same.rel_rms)
    assert not compare_arrays("logits", out, ref, TOL, SIZE)  # every position counted: it fails


def test_a_nan_or_inf_at_a_real_position_fails_and_is_named():
    ref, keep = _logits()
    out = ref.copy()
    out[1, 3, 4] = np.nan  # row 1's second real position
    c = compare_arrays("logits", out, ref, TOL, SIZE, where=keep)
    assert not c and c.nonfinite == (1, 3) and c.nonfinite_in == "output", str(c)
    assert "the output is not finite at [1, 3]" in c.detail() and "the output is not finite at [1, 3]" in str(c)
    assert c.max_abs == np.inf and np.isfinite(c.atol)  # the atol of the reference's values, said as a number
    bad_ref = ref.copy()
    bad_ref[0, 5, 0] = -np.inf
    c = compare_arrays("logits", ref, bad_ref, TOL, SIZE, where=keep)
    assert not c and c.nonfinite == (0, 5) and c.nonfinite_in == "reference", str(c)
    c = compare_arrays("logits", out, ref, TOL, SIZE)  # no mask: named over all but the last dim
    assert not c and c.nonfinite == (1, 3)


def test_positions_that_do_not_fit_the_arrays_are_a_shape_error():
    ref, keep = _logits()
    c = compare_arrays("logits", ref, ref, TOL, SIZE, where=keep[:, :5])
    assert not c and "does not start with its positions' [2, 5]" in c.shape_error
