"""Parity of a lowered model against the model it was lowered from, on new shapes.

Both run on ONNX Runtime: the reference on CPU, the candidate on the target provider. The
inputs come from attnx.model.inputs.make_inputs (batch element 1 of a key padding mask
hides every key, so the fully hidden row is always checked), the tolerance from the one
table in attnx.model.tolerance for the candidate's dtype and backend.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np

from attnx.export._check import case_label
from attnx.model.config import AttentionConfig
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import Comparison, ProblemSize, compare_arrays, problem_size, reduction_length, tolerance_for

__all__ = ["PARITY_SHAPES", "compare_models", "failed_run"]

logger = logging.getLogger(__name__)

# (batch, seq, mem_seq): none is the export's example (2, 5, 6); seq 1, a batch of 3 (whose
# element 1 hides every key), and a length past one block of ORT's CPU flash kernel.
PARITY_SHAPES: tuple[tuple[int, int, int], ...] = ((1, 1, 3), (3, 17, 1), (2, 600, 13))


def failed_run(name: str, error: BaseException | str) -> Comparison:
    """A comparison that failed because the model did not run at all."""
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    nan = float("nan")
    return Comparison(name, False, nan, nan, nan, nan, nan, 0.0, 0.0, nan, shape_error=f"does not run: {text}")


def compare_models(
    reference: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    config: AttentionConfig,
    *,
    dtype: str = "fp32",
    provider: str = "cpu",
    shapes: Sequence[tuple[int, int, int]] = PARITY_SHAPES,
    weights: Mapping[str, np.ndarray] | None = None,
) -> list[Comparison]:
    """y of `candidate` (on ort-<provider>) against y of `reference` (on ort-cpu) at `shapes`.

    dtype is the candidate's compute dtype (it picks the tolerance row). weights, the q/k
    projections (qk_weights), size the tolerance by the largest attention score; without
    them the rule's score term is 0, which is stricter. Raises ProviderUnavailable when the
    provider cannot run here; a candidate that fails to run is a failed comparison."""
    from attnx.runtimes import ModelSource, create_runner

    backend = f"ort-{provider}"
    tol = tolerance_for(dtype, backend)
    ref_runner = create_runner("ort-cpu", ModelSource(config, None, os.fspath(reference), "fp32")).load()
    cand_runner = create_runner(backend, ModelSource(config, None, os.fspath(candidate), dtype)).load()
    results: list[Comparison] = []
    try:
        ref_dtype, cand_dtype = ref_runner.inputs[0].dtype, cand_runner.inputs[0].dtype
        for batch, seq, mem_seq in shapes:
            mem = mem_seq if config.cross else None
            label = case_label(batch, seq, mem)
            ref_feeds = make_inputs(config, batch, seq, mem, dtype=ref_dtype, seed=seq)
            cand_feeds = make_inputs(config, batch, seq, mem, dtype=cand_dtype, seed=seq)
            ref_y = ref_runner.run(ref_feeds)["y"]
            try:
                y = cand_runner.run(cand_feeds)["y"]
            except Exception as e:  # noqa: BLE001 - ORT raises its own types; the reason is the result
                results.append(failed_run(label, e))
                continue
            size = (
                problem_size(config, weights, ref_feeds)
                if weights is not None
                else ProblemSize(reduction_length(config, mem or seq))
            )
            cmp = compare_arrays(label, np.asarray(y, np.float32), ref_y, tol, size)
            logger.info("%s", cmp)
            results.append(cmp)
    finally:
        ref_runner.close()
        cand_runner.close()
    return results
