"""ORT offline optimization: the saved graph loads again, says what it is for, agrees with
the original, and the speed helper times both."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attnx.errors import InputError, ModelFileError, ProviderUnavailable, UsageError
from attnx.export import export_onnx, save_model
from attnx.export.passes.fp16 import ConvertToFloat16
from attnx.model import reference_attention
from attnx.model.contract import CONFIG_KEY as CONFIG_METADATA_KEY
from attnx.model.contract import IR_VERSION
from attnx.model.inputs import make_inputs
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.compare import compare_arrays
from attnx.runtimes.ort_offline import OFFLINE_METADATA_KEY, compare_speed, optimize_for_provider
from tests.conftest import CONFIGS, weights_for

NAME = "causal_kpm"  # masks of both kinds and a fully masked batch element


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The float32 and float16 decomposed exports of NAME, saved."""
    root = tmp_path_factory.mktemp("offline")
    config, weights = CONFIGS[NAME], weights_for(NAME)
    paths = {dtype: str(root / f"{NAME}-{dtype}.onnx") for dtype in ("fp32", "fp16")}
    save_model(export_onnx(config, weights), paths["fp32"])
    save_model(ConvertToFloat16()(ir.load(paths["fp32"])).model, paths["fp16"])
    return paths


def _run(path: str, feeds: dict) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as a deployment loads it
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]


def _cuda_usable() -> bool:
    """Whether a CUDA session really starts here (never get_available_providers())."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "p", [x],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=IR_VERSION)  # fmt: skip
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    try:
        got = ort.InferenceSession(model.SerializeToString(), opts, providers=["CUDAExecutionProvider"]).get_providers()
    except Exception:
        return False
    return got[0] == "CUDAExecutionProvider"


@pytest.mark.parametrize("level", ["extended", "all"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_offline_model_loads_records_provider_and_agrees(source, tmp_path, dtype, level):
    config, weights = CONFIGS[NAME], weights_for(NAME)
    out = tmp_path / "opt.onnx"
    result = optimize_for_provider(source[dtype], out, "cpu", level)
    assert result.files == [str(out)] and not result.external_data
    assert sorted(os.listdir(tmp_path)) == ["opt.onnx"]  # no temporary left behind
    assert result.ops_after != result.ops_before  # ORT did rewrite the graph (FusedMatMul, ...)

    proto = onnx.load(out)
    assert proto.ir_version == IR_VERSION
    meta = {p.key: p.value for p in proto.metadata_props}
    assert json.loads(meta[OFFLINE_METADATA_KEY]) == {"provider": "cpu", "level": level, "onnxruntime": ort.__version__}
    assert meta[CONFIG_METADATA_KEY] == config.to_json()  # the model still describes itself

    for batch, seq in [(1, 1), (3, 9)]:
        feeds = make_inputs(config, batch, seq, dtype=dtype, seed=seq)
        y_opt, y_src = _run(str(out), feeds), _run(source[dtype], feeds)
        ref = reference_attention(config, weights, **feeds)
        size = problem_size(config, weights, feeds)
        assert compare_arrays("optimized", y_opt, ref, tolerance_for(dtype), size)
        assert compare_arrays("optimized vs original", y_opt, y_src.astype(np.float64), tolerance_for(dtype), size)
        if batch > 1:  # every key of element 1 is hidden: y is the out bias there
            np.testing.assert_array_equal(y_opt[1], np.broadcast_to(weights["out_proj.bias"].astype(y_opt.dtype),
                                                                    y_opt[1].shape))  # fmt: skip


def test_external_initializers_and_a_stale_data_file(source, tmp_path):
    config, weights = CONFIGS[NAME], weights_for(NAME)
    out = tmp_path / "opt.onnx"
    result = optimize_for_provider(source["fp32"], out, "cpu", "extended", external_data=True)
    data = tmp_path / "opt.onnx.data"
    assert result.external_data and result.files == [str(out), str(data)]
    proto = onnx.load(out, load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"opt.onnx.data"}  # relative, beside the model
    assert os.path.getsize(out) < os.path.getsize(data)  # the weights left the model file
    feeds = make_inputs(config, 2, 6, seed=6)
    y = _run(str(out), feeds)
    assert compare_arrays("y", y, reference_attention(config, weights, **feeds), tolerance_for("fp32"),
                          problem_size(config, weights, feeds))  # fmt: skip

    # Written again without external data: the old data file must not linger.
    optimize_for_provider(source["fp32"], out, "cpu", "extended", external_data=False)
    assert not data.exists()
    assert np.array_equal(_run(str(out), feeds), y)


def test_external_data_is_chosen_by_size(source, tmp_path, monkeypatch):
    import attnx.runtimes.ort_offline as offline

    assert not optimize_for_provider(source["fp32"], tmp_path / "a.onnx").external_data  # 17 kB of weights
    monkeypatch.setattr(offline, "EXTERNAL_DATA_THRESHOLD", 10_000)  # as if they passed 2 GB
    result = optimize_for_provider(source["fp32"], tmp_path / "b.onnx")
    assert result.external_data and (tmp_path / "b.onnx.data").exists()


def test_cuda_without_a_usable_provider_is_unavailable(source, tmp_path):
    out = tmp_path / "cuda.onnx"
    if _cuda_usable():
        result = optimize_for_provider(source["fp32"], out, "cuda", "extended")
        assert json.loads({p.key: p.value for p in onnx.load(out).metadata_props}[OFFLINE_METADATA_KEY])[
            "provider"
        ] == "cuda"
        assert result.provider == "cuda"
        return
    with pytest.raises(ProviderUnavailable, match="cannot use provider 'cuda'"):
        optimize_for_provider(source["fp32"], out, "cuda", "extended")
    assert os.listdir(tmp_path) == []  # nothing written, no temporary left


def test_bad_arguments_are_usage_errors(source, tmp_path):
    with pytest.raises(UsageError, match="unknown provider 'tpu'"):
        optimize_for_provider(source["fp32"], tmp_path / "o.onnx", "tpu")
    with pytest.raises(UsageError, match="unknown optimization level 'max'"):
        optimize_for_provider(source["fp32"], tmp_path / "o.onnx", "cpu", "max")
    with pytest.raises(ModelFileError, match="does not exist"):
        optimize_for_provider(tmp_path / "missing.onnx", tmp_path / "o.onnx")
    with pytest.raises(UsageError, match="would overwrite its source"):
        optimize_for_provider(source["fp32"], source["fp32"])
    with pytest.raises(UsageError, match="output folder .* does not exist"):
        optimize_for_provider(source["fp32"], tmp_path / "nowhere" / "o.onnx")


def test_compare_speed_returns_the_numbers(source, tmp_path):
    out = tmp_path / "opt.onnx"
    optimize_for_provider(source["fp32"], out, "cpu", "all")
    feeds = make_inputs(CONFIGS[NAME], 2, 16)
    cmp = compare_speed(source["fp32"], out, feeds, repeat=5, warmup=1, threads=1, load_repeat=2)
    for r, level in ((cmp.a, "all"), (cmp.b, "disabled")):
        assert r.level == level and len(r.runs_s) == 5
        assert all(t > 0 for t in r.runs_s) and r.load_s > 0
        assert r.min_s <= r.median_s <= max(r.runs_s)
    assert cmp.speedup == pytest.approx(cmp.a.median_s / cmp.b.median_s)
    record = json.loads(json.dumps(cmp.to_dict()))  # plain JSON, for result files
    assert record["threads"] == 1 and len(record["b"]["runs_s"]) == 5
    assert "median ms" in str(cmp)

    with pytest.raises(InputError, match="the feeds do not fit"):
        compare_speed(source["fp32"], out, {"x": feeds["x"]}, repeat=1)  # no key_padding_mask
    with pytest.raises(UsageError, match="repeat and load_repeat must be at least 1"):
        compare_speed(source["fp32"], out, feeds, repeat=0)
