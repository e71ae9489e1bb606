"""The int8 rounding of an intermediate (MatMulNBits accuracy_level 4) against ONNX Runtime's own kernel: an input a
float rounding away from a midpoint of its int8 block is rounded either way by the kernel, y then moves by one step
times a column of W, and attnx.model.tolerance.requantization_slack holds y to either rounding (and only there)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from attnx.model.tolerance import ProblemSize, RequantizedTolerance, requantization_slack, tolerance_for
from attnx.runtimes.compare import compare_arrays
from attnx.workflows.audit.compare import int8_blocks

ort = pytest.importorskip("onnxruntime")

K, N, BLOCK = 64, 8, 32


def _matmul_nbits(levels: np.ndarray, scales: np.ndarray) -> ort.InferenceSession:
    """y = a W^T, W [N, K] = (levels - 8) * scales per block of BLOCK along K, at accuracy_level 4 (int8 inputs)."""
    low, high = levels[..., 0::2], levels[..., 1::2]  # two 4-bit values a byte, the first in the low nibble
    packed = (low | (high << 4)).astype(np.uint8).reshape(N, K // BLOCK, BLOCK // 2)
    node = helper.make_node("MatMulNBits", ["a", "b", "scales"], ["y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=BLOCK, accuracy_level=4)  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])],
        [onnx.numpy_helper.from_array(packed, "b"), onnx.numpy_helper.from_array(scales.astype(np.float32), "scales")],
    )  # fmt: skip
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                 helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_a_value_at_a_rounding_midpoint_moves_y_by_one_step_and_the_slack_holds_it():
    rng = np.random.default_rng(0)
    levels = rng.integers(0, 16, (N, K), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.02, (N, K // BLOCK))
    weight = (levels.astype(np.float64) - 8) * np.repeat(scales, BLOCK, axis=1)  # [N, K], what the kernel multiplies
    session = _matmul_nbits(levels, scales)
    # z: each block's largest |value| 1.27 (an int8 step of 0.01); every value a third of a level from its midpoints
    # but one, 0.105 (level 10.5), moved 2e-7 either way: a float rounding, far inside fp32's rule at z (6e-6 here)
    z = ((rng.integers(-120, 120, (1, K)) + 0.2) * 0.01).astype(np.float32)
    z[0, 0] = z[0, BLOCK] = 1.27
    lo, hi = z.copy(), z.copy()
    lo[0, 5], hi[0, 5] = 0.105 - 2e-7, 0.105 + 2e-7
    y_lo, y_hi = (session.run(None, {"a": a})[0].astype(np.float64) for a in (lo, hi))
    step = 1.27 / 127
    assert np.allclose(y_hi - y_lo, step * weight[:, 5], rtol=1e-3, atol=1e-6)  # the kernel rounded them apart

    tol, size = tolerance_for("fp32"), ProblemSize(K)
    requantized = requantization_slack(tol, size, lo, weight, BLOCK)
    assert requantized.ambiguous == 1 and requantized.elements == K
    assert np.allclose(requantized.slack, step * np.abs(weight[:, 5]), rtol=1e-5)
    ref = int8_blocks(lo, BLOCK) @ weight.T  # the audit's reference of `lo`: rounds it down, as the kernel did
    held = RequantizedTolerance.of(tol, requantized.slack)
    for y in (y_lo, y_hi):
        assert compare_arrays("y", y, ref, held, size)  # either rounding is within the slack
    assert compare_arrays("y", y_lo, ref, tol, size) and not compare_arrays("y", y_hi, ref, tol, size)


def test_values_away_from_the_midpoints_get_no_slack():
    """Away from every midpoint (a third of a level), the float rule alone holds: the slack is zero everywhere, so
    an error of y that is not the kernel's rounding of z gets no room from it."""
    rng = np.random.default_rng(1)
    z = ((rng.integers(-120, 120, (3, 4, K)) + 0.3) * 0.01).astype(np.float32)
    z[..., 0] = z[..., BLOCK] = 1.27
    requantized = requantization_slack(tolerance_for("fp32"), ProblemSize(K, 30.0), z, rng.standard_normal((N, K)), BLOCK)
    assert requantized.ambiguous == 0 and requantized.slack.shape == (3, 4, N) and not requantized.slack.any()
