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


def _foreign_model(path, unranked):
    """A model another tool wrote (no attnx.config): a cache input whose dim is not attnx's past_seq, a dim without
    a name, an input of unknown rank (unranked; OpenVINO's CPU plugin compiles none), and one dim name on two inputs
    that need not agree."""
    import onnx
    from onnx import TensorProto, helper

    past = helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, "past_sequence_length", 4])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, None, 4])
    other = helper.make_tensor_value_info("other", TensorProto.FLOAT, ["past_sequence_length"])
    scalar = helper.make_tensor_value_info("scalar", TensorProto.FLOAT, None if unranked else [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, None, 4])
    nodes = [helper.make_node("Concat", ["past", "x"], ["c"], axis=1),
             helper.make_node("ReduceSum", ["other"], ["s"], keepdims=0),
             helper.make_node("Add", ["s", "scalar"], ["t"]), helper.make_node("Add", ["c", "t"], ["y"])]  # fmt: skip
    graph = helper.make_graph(nodes, "foreign", [past, x, other, scalar], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10), str(path))
    return str(path)


@pytest.mark.parametrize("backend", ["ort-cpu", "openvino"])
def test_a_model_another_tool_wrote_is_held_to_its_declared_inputs_alone(tmp_path, backend):
    """Outside attnx's contract, a dim's name is its exporter's: an empty cache axis, a dim without a name and one
    name fed two sizes are the runtime's to judge; names, dtypes and fixed dims are still checked."""
    from attnx.runtimes.base import backend_unavailable_reason

    if (reason := backend_unavailable_reason(backend)) is not None:
        pytest.skip(reason)
    feeds = {"past": np.zeros((2, 0, 4), np.float32), "x": np.ones((2, 3, 4), np.float32),
             "other": np.ones(5, np.float32), "scalar": np.array(1.0, np.float32)}  # fmt: skip
    with create_runner(backend, ModelSource(model_path=_foreign_model(tmp_path / "m.onnx", backend != "openvino"))) as r:
        assert not r.contract
        np.testing.assert_array_equal(r.run(feeds)["y"], np.full((2, 3, 4), 7.0, np.float32))
        with pytest.raises(InputError, match="'x' has size 3 on axis 0, expected 2"):
            r.run({**feeds, "x": np.ones((3, 3, 4), np.float32)})
        with pytest.raises(InputError, match="'other' has dtype fp64, expected fp32"):
            r.run({**feeds, "other": np.ones(5)})


def test_a_runner_chains_the_runtime_s_own_error(tmp_path):
    """The audit reports a load failure in the runtime's own words: the runner's error chains it."""
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(ModelFileError) as caught:
        create_runner("ort-cpu", ModelSource(model_path=str(junk))).load()
    assert caught.value.__cause__ is not None and "ONNXRuntimeError" in str(caught.value.__cause__)
