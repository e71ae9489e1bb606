"""attnx.export.save_model, the one writer of an onnx-ir model (issue 52): atomic (the data file too), the IR
version, one threshold (protobuf's 2 GiB less room for the graph), external data where the input's tensors are
external, an ordinary file mode, and tensors kept in the data file a second model shares."""

from __future__ import annotations

import os
import stat

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import attnx.export._export as export_impl
from attnx.errors import ExportError
from attnx.export import save_model
from attnx.model.contract import EXTERNAL_DATA_THRESHOLD, IR_VERSION

N = 1024  # floats in the weight: 4096 bytes, past onnx-ir's 256-byte floor for external tensors
WEIGHT = np.arange(N, dtype=np.float32)


def _model(*, ir_version: int = 13) -> ir.Model:
    """y = x + w, w a float32 initializer of N values, written at another IR version than attnx's."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N])],
        [numpy_helper.from_array(WEIGHT, "w")],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=ir_version))


def _locations(path) -> set[str]:
    proto = onnx.load(str(path), load_external_data=False)
    return {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}


def _weight(path) -> np.ndarray:
    return numpy_helper.to_array(onnx.load(str(path)).graph.initializer[0])


def test_the_threshold_is_protobufs_limit_less_room_for_the_graph():
    assert EXTERNAL_DATA_THRESHOLD == 2 * 1024**3 - 64 * 1024**2


def test_one_file_at_attnx_ir_version_up_to_the_threshold_a_data_file_past_it(tmp_path, monkeypatch):
    """The initializers' bytes against the threshold: at it, one file; one byte past it, `<name>.data` beside the
    model with a relative location. Either way IR_VERSION, whatever the model held (13 here)."""
    monkeypatch.setattr(export_impl, "EXTERNAL_DATA_THRESHOLD", WEIGHT.nbytes)
    assert save_model(_model(), tmp_path / "at.onnx") == [str(tmp_path / "at.onnx")]
    assert _locations(tmp_path / "at.onnx") == set()
    monkeypatch.setattr(export_impl, "EXTERNAL_DATA_THRESHOLD", WEIGHT.nbytes - 1)
    files = save_model(_model(), tmp_path / "past.onnx")
    assert files == [str(tmp_path / "past.onnx"), str(tmp_path / "past.onnx.data")]
    assert _locations(tmp_path / "past.onnx") == {"past.onnx.data"}
    assert sorted(os.listdir(tmp_path)) == ["at.onnx", "past.onnx", "past.onnx.data"]  # no staging left
    for name in ("at.onnx", "past.onnx"):
        assert onnx.load(str(tmp_path / name), load_external_data=False).ir_version == IR_VERSION
        np.testing.assert_array_equal(_weight(tmp_path / name), WEIGHT)


def test_a_model_whose_tensors_are_external_gets_a_data_file_of_its_own(tmp_path):
    """Read back from disk with its data file (as another tool writes one), saved elsewhere: its tensors copied into
    the new model's own data file, never a reference to the first one's (removed here before reading)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_model(_model(), tmp_path / "a" / "m.onnx", external_data=True)
    model = ir.load(tmp_path / "a" / "m.onnx")
    assert isinstance(model.graph.initializers["w"].const_value, ir.ExternalTensor)
    save_model(model, tmp_path / "b" / "n.onnx")
    del model
    os.remove(tmp_path / "a" / "m.onnx.data")
    assert _locations(tmp_path / "b" / "n.onnx") == {"n.onnx.data"}
    np.testing.assert_array_equal(_weight(tmp_path / "b" / "n.onnx"), WEIGHT)


def test_files_written_have_an_ordinary_mode(tmp_path):
    """onnx-ir writes the data file through a private temporary file (0600): both files get the umask's mode."""
    umask = os.umask(0o022)
    try:
        save_model(_model(), tmp_path / "m.onnx", external_data=True)
    finally:
        os.umask(umask)
    for name in ("m.onnx", "m.onnx.data"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name


def _failing_model() -> ir.Model:
    """A model whose second weight cannot be read (a disk that fails mid-write): written after the first."""
    model = _model()

    def unreadable() -> ir.Tensor:
        raise OSError("the disk went away")

    lazy = ir.LazyTensor(unreadable, dtype=ir.DataType.FLOAT, shape=ir.Shape([N]), name="w2")
    w2 = ir.Value(name="w2", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([N]), const_value=lazy)
    model.graph.register_initializer(w2)
    model.graph.outputs.append(w2)
    return model


@pytest.mark.parametrize("external_data", [True, False])
def test_a_failed_save_leaves_the_model_and_its_data_file_as_they_were(tmp_path, external_data):
    save_model(_model(), tmp_path / "m.onnx", external_data=True)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    for name in ("m.onnx", "new.onnx"):
        with pytest.raises(Exception) as failed:  # onnx-ir wraps it (SerdeError) when it embeds the tensor
            save_model(_failing_model(), tmp_path / name, external_data=external_data)
        error: BaseException | None = failed.value
        while error is not None and not isinstance(error, OSError):
            error = error.__cause__
        assert str(error) == "the disk went away"
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_external_data_false_keeps_the_tensors_in_the_data_file_beside_it(tmp_path):
    """The buffer form's decode.onnx: a second model reading the first's data file, which it does not copy; a model
    whose data file would not be beside the new one is refused, with the tensor named."""
    save_model(_model(), tmp_path / "model.onnx", external_data=True)
    model = ir.load(tmp_path / "model.onnx")
    assert save_model(model, tmp_path / "decode.onnx", external_data=False) == [str(tmp_path / "decode.onnx")]
    assert _locations(tmp_path / "decode.onnx") == {"model.onnx.data"}
    assert sorted(os.listdir(tmp_path)) == ["decode.onnx", "model.onnx", "model.onnx.data"]
    np.testing.assert_array_equal(_weight(tmp_path / "decode.onnx"), WEIGHT)
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ExportError, match=r"cannot keep tensor 'w' in its data file .*model\.onnx\.data"):
        save_model(model, tmp_path / "elsewhere" / "decode.onnx", external_data=False)
    assert os.listdir(tmp_path / "elsewhere") == []


def test_external_data_false_past_the_threshold_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(export_impl, "EXTERNAL_DATA_THRESHOLD", WEIGHT.nbytes - 1)
    with pytest.raises(ExportError, match="cannot write .* as one file: its tensors hold 4096 bytes"):
        save_model(_model(), tmp_path / "m.onnx", external_data=False)
    assert os.listdir(tmp_path) == []
