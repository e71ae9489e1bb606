"""The Runner contract: load/run/close, context manager, feed validation, registry."""

from __future__ import annotations

import numpy as np
import pytest

from attnx.errors import InputError, ModelFileError, UsageError
from attnx.model import reference_attention
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes import ModelSource, backend_names, compare_arrays, create_runner
from tests.conftest import CONFIGS, weights_for


def test_registry_lists_every_contract_backend():
    assert {"torch", "torch-cuda", "ort-cpu", "ort-cuda", "reference"} <= set(backend_names())
    with pytest.raises(UsageError, match="unknown backend 'tensorrt'"):
        create_runner("tensorrt", ModelSource())


@pytest.fixture(params=["reference", "torch", "ort-cpu"])
def runner(request, exported):
    config = CONFIGS["cross_kpm"]
    source = ModelSource(config, weights_for("cross_kpm"), exported("cross_kpm"))
    with create_runner(request.param, source) as r:
        yield r


def test_runner_runs_valid_feeds(runner):
    config, weights = CONFIGS["cross_kpm"], weights_for("cross_kpm")
    feeds = make_inputs(config, 2, 3, 5)
    y = runner.run(feeds)["y"]
    assert y.shape == (2, 3, 32)
    # the values, not just the shape: a runner returning zeros (or the bias alone) fails here
    ref = reference_attention(config, weights, **feeds)
    cmp = compare_arrays("y", y, ref, tolerance_for("fp32"), problem_size(config, weights, feeds))
    assert cmp, cmp


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: f.pop("memory"), "missing input 'memory'"),
        (lambda f: f.update(extra=np.zeros(1)), "unexpected input 'extra'"),
        (lambda f: f.update(x=f["x"][0]), "'x' has rank 2"),
        (lambda f: f.update(x=f["x"].astype(np.float64)), "'x' has dtype fp64, expected fp32"),
        (lambda f: f.update(key_padding_mask=f["key_padding_mask"].astype(np.int32)), "dtype int32, expected bool"),
        (lambda f: f.update(memory=f["memory"][..., :7]), "'memory' has size 7 on axis 2, expected 40"),
        (lambda f: f.update(memory=f["memory"][:1]), "batch=1"),
        (lambda f: f.update(key_padding_mask=f["key_padding_mask"][:, :4]), "mem_seq=4"),
        (lambda f: f.update(x=f["x"][:, :0]), "empty axis 1"),
    ],
)
def test_bad_feeds_get_one_clear_error(runner, change, message):
    feeds = make_inputs(CONFIGS["cross_kpm"], 2, 3, 5)
    change(feeds)
    with pytest.raises(InputError, match=message):
        runner.run(feeds)


def test_run_before_load_is_an_error(exported):
    r = create_runner("ort-cpu", ModelSource(model_path=exported("self")))
    with pytest.raises(UsageError, match="not loaded"):
        r.run({})


def test_missing_sources_are_named(tmp_path):
    with pytest.raises(UsageError, match="needs an ONNX model"):
        create_runner("ort-cpu", ModelSource()).load()
    with pytest.raises(UsageError, match="needs a config"):
        create_runner("reference", ModelSource()).load()
    with pytest.raises(ModelFileError, match="does not exist"):
        create_runner("ort-cpu", ModelSource(model_path=str(tmp_path / "nope.onnx"))).load()
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(ModelFileError, match="onnxruntime cannot load"):
        create_runner("ort-cpu", ModelSource(model_path=str(junk))).load()


def test_ort_runner_reads_metadata_from_the_model(exported):
    with create_runner("ort-cpu", ModelSource(model_path=exported("kpm"))) as r:
        assert [(s.name, s.dtype, s.shape) for s in r.inputs] == [
            ("x", "fp32", ("batch", "seq", 32)),
            ("key_padding_mask", "bool", ("batch", "seq")),
        ]
