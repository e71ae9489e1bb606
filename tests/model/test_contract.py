"""The contract: one table per concept, and describe(), the one reader of a model file."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from attnx.bench import BenchPlan
from attnx.bench._worker import write_gemm_model
from attnx.errors import ModelFileError, UsageError
from attnx.export import build_model, lowering_of, save_model
from attnx.model import contract
from attnx.model.contract import (
    DTYPES,
    LOWERINGS,
    PROVIDERS,
    backend_device,
    describe,
    dtype_name,
    dtype_of_onnx,
    dtype_of_ort,
    get_provider,
    lowering_from_nodes,
    provider_of_backend,
)
from attnx.runtimes import backend_names
from tests.conftest import CONFIGS, weights_for


def test_every_dtype_has_one_spelling_per_library():
    torch = pytest.importorskip("torch")
    import onnx

    for d in DTYPES.values():
        assert getattr(torch, d.torch).is_floating_point == (d.name in ("fp32", "fp16", "bf16", "fp64"))
        assert onnx.helper.tensor_dtype_to_np_dtype(d.onnx) is not None
        assert dtype_of_onnx(d.onnx) == d.name and dtype_of_ort(d.ort) == d.name
        assert dtype_name(getattr(torch, d.torch)) == d.name
        if d.numpy:
            assert dtype_name(np.zeros(1, d.numpy)) == d.name
            assert onnx.helper.tensor_dtype_to_np_dtype(d.onnx) == np.dtype(d.numpy)


def test_dtype_name_reads_the_dtype_and_never_formats_the_value():
    """Runner.run checks every feed's dtype: formatting a feed (str of a 512x512 array) cost a
    quarter of a millisecond per call, 15% of a GEMM's run in the bench."""

    class Feed:
        dtype = np.dtype(np.float16)

        def __str__(self):
            raise AssertionError("formatted")

        __repr__ = __str__

    assert dtype_name(Feed()) == "fp16" and dtype_name(np.dtype(bool)) == "bool" and dtype_name(3) == "int"


def test_providers_backends_and_devices_agree_with_the_runtime_registry():
    registered = set(backend_names())
    assert set(contract.BACKEND_NAMES) == registered
    # the audit runs a cut block's file: on every backend that runs a model file, and on no other
    assert set(contract.AUDIT_BACKENDS) == {b for b in contract.BACKEND_NAMES if contract.runs_onnx_model(b)}
    for p in PROVIDERS.values():
        assert {p.backend, p.torch_backend} <= registered
        assert provider_of_backend(p.backend) is p and provider_of_backend(p.torch_backend) is None
        assert backend_device(p.backend) == backend_device(p.torch_backend) == p.name
    assert backend_device(contract.REFERENCE) is None
    assert get_provider("cuda").ort_name == "CUDAExecutionProvider"
    with pytest.raises(UsageError, match=r"unknown --provider 'tpu' \(known: cpu, cuda\)"):
        get_provider("tpu", "--provider")


def test_lowering_tables_are_views_of_one_table():
    assert contract.EXPORT_ATTENTIONS == ("decomposed", "onnx", "ort-fused", "measure")
    assert contract.OPTIMIZE_ATTENTIONS == ("decomposed", "onnx", "ort-fused", "ort-fused-packed", "ort-attention", "measure")
    assert contract.BENCH_ORT_LOWERINGS == ("decomposed", "onnx", "ort-fused")
    assert {lw.torch_core for lw in LOWERINGS.values()} - {None} <= set(contract.TORCH_CORES)
    assert contract.BUILD_ATTENTION in contract.EXPORT_ATTENTIONS


def test_lowering_from_nodes_tells_every_form_apart():
    from attnx.model.seen import Seen

    ms = contract.MS_DOMAIN
    assert lowering_from_nodes([Seen("", "MatMul"), Seen("", "Softmax", "MatMul")]) == "decomposed"
    assert lowering_from_nodes([Seen("", "Attention", "Transpose")]) == "onnx"
    assert lowering_from_nodes([Seen(ms, "MultiHeadAttention", "MatMul")]) == "ort-fused"
    assert lowering_from_nodes([Seen(ms, "MultiHeadAttention", "Split")]) == "ort-fused-packed"
    assert lowering_from_nodes([Seen(ms, "Attention")]) == "ort-attention"


@pytest.mark.parametrize("lowering", ["ort-fused", "ort-fused-packed", "ort-attention"])
def test_describe_reads_the_lowering_from_the_graph_and_bench_labels_it(tmp_path, lowering):
    config = CONFIGS["self"]
    model = ir.from_proto(build_model(config, weights_for("self"), lowering))
    path = str(tmp_path / f"{lowering}.onnx")
    model.metadata_props[contract.ATTENTION_KEY] = "decomposed"  # a lie: the graph decides
    save_model(model, path)
    assert lowering_of(ir.load(path)) == lowering
    info = describe(path)
    assert (info.config, info.lowering, info.dtype) == (config, lowering, "fp32")
    # bench's series label comes from the same reader: a packed or Attention model is not "ort-fused"
    assert BenchPlan(config, backends=["ort-cpu"], model_path=path).series() == [("ort-cpu", lowering)]


def test_describe_gives_config_dims_and_dtype(exported):
    info = describe(exported("cross_kpm", "ort-fused", "fp16"))
    assert info.config == CONFIGS["cross_kpm"] and info.lowering == "ort-fused"
    assert info.dtype == info.io_dtype == "fp16"
    assert [(s.name, s.dtype, s.shape) for s in info.inputs] == [
        ("x", "fp16", ("batch", "seq", 32)),
        ("memory", "fp16", ("batch", "mem_seq", 40)),
        ("key_padding_mask", "bool", ("batch", "mem_seq")),
    ]
    n = CONFIGS["cross_kpm"].n_params
    assert 2 * n <= info.initializer_bytes < 2 * n + 4096  # the fp16 weights, and a few shape constants
    d = info.to_dict()
    assert d["inputs"][0] == {"name": "x", "dtype": "fp16", "shape": ["batch", "seq", 32]}
    assert d["metadata"][contract.DTYPE_KEY] == "fp16" and contract.CONFIG_KEY not in d["metadata"]
    assert json.dumps(d)  # JSON as it is


def test_describe_refuses_what_is_not_an_attnx_model(tmp_path):
    plain = tmp_path / "plain.onnx"
    write_gemm_model(str(plain), 2, 2, 2, "fp32")
    info = describe(plain)  # an ONNX model, just not attnx's
    assert info.config is None and "no 'attnx.config' metadata" in info.config_error
    with pytest.raises(ModelFileError, match="no 'attnx.config' metadata"):
        info.require_config()
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelFileError, match="is not an ONNX model"):
        describe(tmp_path / "junk.onnx")
    with pytest.raises(ModelFileError, match="does not exist"):
        describe(tmp_path / "none.onnx")


def test_the_backends_that_run_model_files_run_the_quantized_forms_and_torch_says_why_not():
    from attnx.model.contract import quantized_form_unavailable

    assert quantized_form_unavailable("ort-cpu", "int8") is None and quantized_form_unavailable("ort-cuda", "int4") is None
    assert quantized_form_unavailable("openvino", "int8") is None  # its own input quantization: its tolerance rows
    assert quantized_form_unavailable("torch", "fp32") is None  # not a quantized form
    reason = quantized_form_unavailable("torch", "int4")
    assert "runs no ONNX graph" in reason and "MatMulNBits" in reason


def _graphs():
    from attnx.model.seen import Seen

    ms, mha, gqa = contract.MS_DOMAIN, "MultiHeadAttention", "GroupQueryAttention"
    own = (True,) * 8  # past_key and past_value given, past_sequence_length not (the growing form)
    shared = (True,) * 9  # past_sequence_length given: the shared cache (the buffer form)
    growing_if = Seen("", "If", branches=(Seen(ms, mha, "Reshape", own, rows=True), Seen(ms, gqa, "MatMul")))
    buffer_if = Seen("", "If", branches=(Seen(ms, mha, "Reshape", shared, rows=True), Seen(ms, gqa, "MatMul")))
    return [
        ([Seen(ms, "Attention", "Add")], "ms-attention", ["ms-attention"]),
        ([growing_if], "switch", ["switch"]),  # the growing form's If is the core
        ([buffer_if], "switch", [None]),  # the buffer form's is read as its branches' cores
        ([Seen(ms, gqa, "MatMul")], "gqa", ["gqa"]),
        ([Seen(ms, mha, "Split")], "mha-packed", ["mha-packed"]),
        ([Seen(ms, mha, "Split"), Seen(ms, mha, "Add")], "mha", ["mha-packed", "mha"]),
        ([Seen(ms, mha, "Reshape", own, rows=True)], "grouped-mha", ["grouped-mha"]),
        ([Seen("", "Attention", "Reshape")], "attention23", ["attention23"]),
        ([Seen("", "MatMul"), Seen("", "Softmax", "Add")], "decomposed", [None, "decomposed"]),
        ([Seen("", "Softmax", "Add"), Seen(ms, gqa, "MatMul")], "gqa", ["decomposed", "gqa"]),  # a router's Softmax
        ([Seen("", "If", branches=(Seen(ms, gqa, "MatMul"),))], "gqa", [None]),  # a core inside another If
    ]


@pytest.mark.parametrize(("nodes", "core", "each"), _graphs())
def test_a_graph_s_core_is_found_by_its_entry_s_op_domain_and_tells(nodes, core, each):
    from attnx.model.recognise import graph_core, recognise
    from attnx.model.seen import Found

    assert graph_core(nodes) == core
    assert [name if found is Found.NODE else None for name, found in map(recognise, nodes)] == each
