"""The torch module against the numpy reference, and the mask semantics of the contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnx.model import build_module, init_weights, reference_attention
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays
from tests.conftest import CONFIGS


def _run(module, feeds):
    with torch.no_grad():
        return module(**{k: torch.from_numpy(v) for k, v in feeds.items()}).numpy()


@pytest.mark.parametrize("impl", ["decomposed", "sdpa"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_module_matches_reference(name, impl):
    config = CONFIGS[name]
    w = init_weights(config, 1)
    module = build_module(config, w, core=impl)
    for batch, seq, mem in [(1, 1, 1), (3, 7, 5), (2, 33, 12)]:
        feeds = make_inputs(config, batch, seq, mem if config.cross else None, seed=seq)
        ref = reference_attention(config, w, **feeds)
        cmp = compare_arrays("y", _run(module, feeds), ref, tolerance_for("fp32"), problem_size(config, w, feeds))
        assert cmp, str(cmp)


@pytest.mark.parametrize("impl", ["decomposed", "sdpa"])
def test_fully_hidden_query_gives_output_bias_not_nan(impl):
    config = CONFIGS["causal_kpm"]
    w = init_weights(config, 1)
    feeds = make_inputs(config, 3, 6, seed=0)
    assert feeds["key_padding_mask"][1].all()  # element 1 hides every key
    y = _run(build_module(config, w, core=impl), feeds)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y[1], np.broadcast_to(w["out_proj.bias"], y[1].shape), atol=1e-7)
    ref = reference_attention(config, w, **feeds)
    np.testing.assert_allclose(ref[1], np.broadcast_to(w["out_proj.bias"], ref[1].shape), atol=1e-12)


def test_causal_mask_hides_future_keys():
    config = CONFIGS["causal"]
    w = init_weights(config, 1)
    x = make_inputs(config, 1, 6, seed=0)["x"]
    x2 = x.copy()
    x2[0, 4:] += 10.0  # change only the last tokens
    module = build_module(config, w)
    a, b = _run(module, {"x": x}), _run(module, {"x": x2})
    np.testing.assert_array_equal(a[0, :4], b[0, :4])  # earlier queries cannot see them
    assert not np.allclose(a[0, 4:], b[0, 4:])


def test_fp16_module_has_no_overflow_in_masks():
    config = CONFIGS["kpm"]
    w = init_weights(config, 1)
    module = build_module(config, w).half()
    feeds = make_inputs(config, 3, 9, dtype="fp16", seed=0)
    y = _run(module, feeds)
    assert y.dtype == np.float16 and np.isfinite(y).all()
