"""A whole model's proofs as result objects (attnx.workflows._proof): false for a failure alone, printed as the line the
report has always printed, a failed comparison's line ending with the atol that would have passed (as Polygraphy's
comparator says it), the statistics in the --json report beside the lines, which stay strings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnx.model.config import TensorSpec
from attnx.model.tolerance import ProblemSize, whole_model_tolerance
from attnx.runtimes.compare import Comparison, compare_arrays
from attnx.workflows import Proof, ProofStats, ProofStatus
from attnx.workflows._buffer_form import BufferFormResult
from attnx.workflows.rewrite.prove import same_tokens
from attnx.workflows.rewrite.report import ModelOptimizeReport
from attnx.workflows.rewrite.weights import distance_said

TOL, SIZE = whole_model_tolerance("fp32", 1), ProblemSize(64)


def _compared(offset: float) -> tuple[np.ndarray, np.ndarray, Comparison]:
    """A reference and an output `offset` from it (times a pattern), compared under the whole-model row."""
    ref = np.sin(np.arange(64, dtype=np.float64)).reshape(4, 16)
    out = ref + offset * np.cos(np.arange(64)).reshape(4, 16)
    return out, ref, compare_arrays("logits", out, ref, TOL, SIZE)


@pytest.mark.parametrize(("status", "truth", "line"), [
    (ProofStatus.PASS, True, "pass: block 0 (gqa) against the float64 reference"),
    (ProofStatus.FAIL, False, "FAIL: block 0 (gqa) against the float64 reference"),
    (ProofStatus.NOT_COMPARED, True, "not compared: block 0 (gqa) against the float64 reference"),
    (ProofStatus.NOT_CHECKED, True, "not checked: block 0 (gqa) against the float64 reference"),
    (ProofStatus.NOT_READ, True, "not read: block 0 (gqa) against the float64 reference"),
    (ProofStatus.SAID, True, "said: block 0 (gqa) against the float64 reference"),
])  # fmt: skip
def test_a_proof_is_false_for_a_failure_alone_and_prints_its_line(status, truth, line):
    proof = Proof(status, "block 0 (gqa) against the float64 reference")
    assert bool(proof) is truth and str(proof) == line
    detailed = Proof(status, "no block rewritten", "nothing to write")
    assert str(detailed) == line.split(":")[0] + ": no block rewritten: nothing to write"
    assert all([Proof(ProofStatus.PASS, "a"), proof, detailed]) is truth  # code asks all(proofs), never the text


def test_a_failed_comparison_says_the_atol_it_would_pass_at():
    out, ref, cmp = _compared(1e-3)
    assert not cmp
    proof = Proof.verdict(bool(cmp), "block 0 (gqa) against the float64 reference", "block 0: y fails",
                          ProofStats.of(cmp))  # fmt: skip
    assert not proof and proof.status is ProofStatus.FAIL
    needed = proof.needed_atol
    assert needed is not None and needed > proof.stats.atol and needed == pytest.approx(cmp.needed_atol)
    assert str(proof) == ("FAIL: block 0 (gqa) against the float64 reference: block 0: y fails; would pass at "
                          f"atol={needed:.3g}")
    # the atol said is one the comparison passes at (its rtol unchanged), and nothing smaller by a percent is
    assert (np.abs(out - ref) <= needed * (1 + 1e-12) + proof.stats.rtol * np.abs(ref)).all()  # to rounding
    assert not (np.abs(out - ref) <= 0.99 * needed + proof.stats.rtol * np.abs(ref)).all()
    quoted = Proof.verdict(False, "the whole model, full sequence of a left-padded batch",
                           f"the same greedy tokens, logits {cmp.detail()}", ProofStats.of(cmp),
                           quoted=True)  # fmt: skip
    assert str(quoted).count("atol>=") == 1 and "would pass at" not in str(quoted)  # its detail says it, once


def test_a_proof_within_its_bound_or_without_numbers_says_no_tolerance():
    _, _, cmp = _compared(1e-9)
    assert cmp
    within = Proof.verdict(True, "block 1 (gqa) against the float64 reference", stats=ProofStats.of(cmp))
    assert within and within.needed_atol is None and str(within) == "pass: block 1 (gqa) against the float64 reference"
    # a block that fails on a finding while its comparison held: the finding is the reason, no atol would pass it
    finding = Proof.verdict(False, "block 1 (gqa) against the float64 reference", "its window differs",
                            ProofStats.of(cmp))  # fmt: skip
    assert not finding and str(finding).endswith(": its window differs")
    # a NaN compared: no finite number, no atol passes it
    bad = np.ones((2, 3))
    bad[1, 2] = np.nan
    nan = compare_arrays("logits", bad, np.ones((2, 3)), TOL, SIZE)
    proof = Proof.verdict(bool(nan), "the whole model", "not finite", ProofStats.of(nan))
    assert not proof and proof.stats.max_abs is None and proof.needed_atol is None
    assert str(proof) == "FAIL: the whole model: not finite"
    json.dumps(proof.to_dict(), allow_nan=False)


def test_to_dict_gives_the_status_the_line_and_the_statistics():
    _, _, cmp = _compared(1e-3)
    proof = Proof.verdict(False, "block 0 (gqa) against the float64 reference", "y fails", ProofStats.of(cmp))
    got = json.loads(json.dumps(proof.to_dict(), allow_nan=False))
    assert got["status"] == "fail" and got["line"] == str(proof) and got["subject"].startswith("block 0")
    assert got["stats"]["max_abs"] == pytest.approx(cmp.max_abs) and got["stats"]["atol"] == pytest.approx(cmp.atol)
    assert got["stats"]["rtol"] == pytest.approx(cmp.rtol) and got["stats"]["cosine"] == pytest.approx(cmp.cosine)
    assert got["stats"]["rel_rms"] == pytest.approx(cmp.rel_rms)
    assert Proof(ProofStatus.NOT_READ, "node a: its mask not read").to_dict()["stats"] is None
    # a package check's stats without the bound (a manifest written before it kept them): the bound unknown
    old = ProofStats.from_stats(cmp.stats())
    assert old.atol is None and not old.missed and old.max_abs == pytest.approx(cmp.max_abs)


def test_the_reports_keep_their_lines_as_strings_with_the_results_beside():
    _, _, cmp = _compared(1e-3)
    proofs = [Proof(ProofStatus.SAID, "int4: 15 MatMul weight(s) quantized"),
              Proof.verdict(False, "block 0 (gqa) against the float64 reference", "y fails", ProofStats.of(cmp)),
              Proof(ProofStatus.NOT_READ, "node b: not read as attention")]  # fmt: skip
    report = ModelOptimizeReport("in.onnx", "out.onnx", None, [], proofs)
    got = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert got["proofs"] == [str(p) for p in proofs] and got["proofs"][0] == "said: int4: 15 MatMul weight(s) quantized"
    assert [r["status"] for r in got["proof_results"]] == ["said", "fail", "not_read"]
    assert report.lines()[:3] == got["proofs"]
    buffer = BufferFormResult("decode.onnx", proofs=proofs[1:2])
    said = json.loads(json.dumps(buffer.to_dict(), allow_nan=False))
    assert said["proofs"] == [str(proofs[1])] and said["proof_results"][0]["stats"]["needed_atol"] > 0


class _Shifted:
    """A stand-in for a loaded whole model (input_ids, attention_mask -> logits, no cache): each position's logits a
    function of its token, each moved by `shift` (every greedy token kept)."""

    def __init__(self, shift: float) -> None:
        self.shift = shift
        self.inputs = [TensorSpec("input_ids", "int64", ("batch", "sequence")),
                       TensorSpec("attention_mask", "int64", ("batch", "sequence"))]  # fmt: skip
        self.outputs = [TensorSpec("logits", "float32", ("batch", "sequence", 7))]

    def run(self, feeds):
        logits = np.sin(feeds["input_ids"][..., None] * np.arange(1, 8))
        return {"logits": (logits + self.shift).astype(np.float32)}


def test_the_whole_model_proof_is_a_result_with_its_comparisons_numbers():
    report = ModelOptimizeReport("in.onnx", "", None, [], [])
    assert not same_tokens(report, _Shifted(0.0), _Shifted(1e-3), False, TOL, ProblemSize(7))
    (proof,) = report.proofs
    assert not proof and proof.stats is not None and proof.stats.max_abs > proof.stats.atol
    assert str(proof).startswith("FAIL: the whole model, full sequence of a left-padded batch: the same greedy tokens")
    assert str(proof).count("would need atol>=") == 1 and "would pass at" not in str(proof)  # said once, as before
    report = ModelOptimizeReport("in.onnx", "", None, [], [])
    assert same_tokens(report, _Shifted(0.0), _Shifted(0.0), False, TOL, ProblemSize(7))
    assert all(report.proofs) and report.proofs[0].stats.max_abs == 0.0


def test_the_quantized_distance_is_said_never_failed():
    distance = {"prompts": [16, 48], "rel_rms": 0.3, "worst_rel_rms": 0.35, "top1": 0.556, "worst_top1": 0.51}
    proof = distance_said(distance, "int4")
    assert proof and proof.status is ProofStatus.SAID
    assert str(proof) == ("said: the int4 model against the fp32 input, 2 prompts of 16, 48 tokens (full sequence): "
                          "logits relative RMS 0.3 (worst prompt 0.35), top-1 agreement 55.6% (worst prompt 51.0%)")
