"""ONNX Runtime's IOBinding for ort-cuda (IoBinder): inputs and outputs bound on the device, a torch CUDA tensor by
its data pointer (no copy), a numpy array copied once, a static buffer written in place, outputs fetched to the host
only when asked (DeviceOutputs)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import InputError, UsageError
from attnx.model.config import TensorSpec
from attnx.model.contract import DTYPES, dtype_name

__all__ = ["DeviceOutputs", "IoBinder", "contiguous", "resolve_shape"]

logger = logging.getLogger(__name__)

# numpy element types of the dtypes a binding can name (numpy has no bfloat16).
_ELEMENT_TYPES: dict[str, Any] = {d.name: np.dtype(d.numpy).type for d in DTYPES.values() if d.numpy}


def resolve_shape(spec: TensorSpec, dims: Mapping[str, int]) -> tuple[int, ...] | None:
    """The concrete shape of `spec` given the sizes of its symbolic dims, or None when one
    of them is unknown (ORT then allocates the output itself)."""
    out = []
    for dim in spec.shape:
        if isinstance(dim, int):
            out.append(dim)
        elif dim in dims:
            out.append(dims[dim])
        else:
            return None
    return tuple(out)


def _is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # never imported here: a torch tensor means torch is loaded
    return torch is not None and isinstance(value, torch.Tensor)


def _host_array(value: Any) -> np.ndarray:
    if _is_torch_tensor(value):
        value = value.detach().cpu().numpy()
    return contiguous(value)


def contiguous(value: Any) -> np.ndarray:
    """`value` as a C-contiguous numpy array of its own rank (np.ascontiguousarray makes a scalar [1])."""
    array = np.asarray(value)
    return array if array.ndim == 0 else np.ascontiguousarray(array)


# IOBinding ------------------------------------------------------------------------------------
@dataclasses.dataclass
class DeviceOutputs:
    """Outputs of one bound run, left where the run wrote them. `values` holds ORT OrtValues
    on the device, or the caller's own tensors where it passed output buffers. numpy()
    copies them to the host: the only fetch."""

    names: list[str]
    values: dict[str, Any]
    binder: IoBinder

    def numpy(self) -> dict[str, np.ndarray]:
        return self.binder.fetch()

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


class _StaticBuffer:
    """One input kept at a fixed device address for CUDA graph replay: an OrtValue (filled
    from numpy with update_inplace) or a torch tensor of our own (filled with copy_)."""

    def __init__(self, value: Any, ort_value: Any = None, tensor: Any = None) -> None:
        self.shape = tuple(value.shape)
        self.dtype = dtype_name(value)
        self.ort_value = ort_value
        self.tensor = tensor

    def write(self, value: Any) -> None:
        if self.tensor is not None:
            if not _is_torch_tensor(value):
                value = sys.modules["torch"].from_numpy(np.ascontiguousarray(value))
            self.tensor.copy_(value)
        else:
            self.ort_value.update_inplace(_host_array(value))


class IoBinder:
    """Binds one session's inputs and outputs on one device through ORT's IOBinding.

    device_type is "cuda" for ort-cuda; "cpu" works the same way (what the tests without a
    GPU exercise). A torch tensor already on the device is bound by its data pointer (no
    copy; made contiguous first if it is not); a numpy array or a torch CPU tensor becomes
    an OrtValue on the device (one copy). With static=True (CUDA graphs) the first run's
    buffers are kept and later runs copy into them: ORT replays a captured graph on the
    same addresses, so every later run must have the first run's shapes.
    """

    def __init__(self, session: Any, device_type: str, device_id: int = 0, *, static: bool = False) -> None:
        self.session = session
        self.device_type = device_type
        self.device_id = device_id
        self.static = static
        self.binding = session.io_binding()
        self._keep: list[Any] = []  # buffers bound by pointer: alive until the next bind
        self._static_inputs: dict[str, _StaticBuffer] = {}
        self._static_outputs: dict[str, Any] = {}
        self._torch_devices: set[Any] = set()

    # Inputs -------------------------------------------------------------------------------
    def bind_inputs(self, feeds: Mapping[str, Any]) -> None:
        self._torch_devices = set()
        if self.static and self._static_inputs:
            self._write_static(feeds)
            return
        self.binding.clear_binding_inputs()
        self._keep = []
        for name, value in feeds.items():
            if self.static:
                self._bind_static_input(name, value)
            else:
                self._bind_input(name, value)

    def _on_device(self, tensor: Any) -> bool:
        dev = tensor.device
        if dev.type != self.device_type:
            return False
        return self.device_type == "cpu" or (dev.index if dev.index is not None else 0) == self.device_id

    def _bind_input(self, name: str, value: Any) -> None:
        import onnxruntime as ort

        if _is_torch_tensor(value):
            if self._on_device(value):
                self._bind_tensor_pointer(name, value)
                return
            if value.device.type != "cpu":
                raise InputError(
                    f"input {name!r} is on {value.device}, this runner binds on {self.device_type}:{self.device_id}"
                )
            value = value.detach().numpy()
        array = np.ascontiguousarray(value)
        ort_value = ort.OrtValue.ortvalue_from_numpy(array, self.device_type, self.device_id)
        self._keep.append((array, ort_value))
        self.binding.bind_ortvalue_input(name, ort_value)

    def _bind_tensor_pointer(self, name: str, tensor: Any) -> None:
        dtype = dtype_name(tensor)
        if dtype not in _ELEMENT_TYPES:
            raise InputError(f"input {name!r} has dtype {dtype}, which cannot be bound by pointer")
        if not tensor.is_contiguous():
            logger.debug("input %r is not contiguous: bound through a contiguous copy", name)
            tensor = tensor.contiguous()
        self._keep.append(tensor)
        if tensor.device.type == "cuda":
            self._torch_devices.add(tensor.device)
        self.binding.bind_input(
            name, self.device_type, self.device_id, _ELEMENT_TYPES[dtype], tuple(tensor.shape), tensor.data_ptr()
        )

    def _bind_static_input(self, name: str, value: Any) -> None:
        import onnxruntime as ort

        if _is_torch_tensor(value) and self._on_device(value):
            own = value.detach().clone(memory_format=sys.modules["torch"].contiguous_format)
            self._static_inputs[name] = _StaticBuffer(value, tensor=own)
            self._bind_tensor_pointer(name, own)
            return
        array = _host_array(value)
        ort_value = ort.OrtValue.ortvalue_from_shape_and_type(
            array.shape, array.dtype.type, self.device_type, self.device_id
        )
        ort_value.update_inplace(array)
        self._static_inputs[name] = _StaticBuffer(array, ort_value=ort_value)
        self.binding.bind_ortvalue_input(name, ort_value)

    def _write_static(self, feeds: Mapping[str, Any]) -> None:
        for name, value in feeds.items():
            buf = self._static_inputs.get(name)
            if buf is None:
                raise UsageError(f"input {name!r} was not bound in the first run of this CUDA graph")
            if tuple(value.shape) != buf.shape:
                raise UsageError(
                    f"CUDA graphs replay fixed shapes: input {name!r} was captured as {list(buf.shape)}, "
                    f"got {list(value.shape)} (load a new runner for a new shape)"
                )
            if dtype_name(value) != buf.dtype:
                raise UsageError(f"input {name!r} was captured as {buf.dtype}, got {dtype_name(value)}")
            buf.write(value)
            if buf.tensor is not None and buf.tensor.device.type == "cuda":
                self._torch_devices.add(buf.tensor.device)

    # Outputs ------------------------------------------------------------------------------
    def bind_outputs(
        self, specs: list[TensorSpec], dims: Mapping[str, int], out: Mapping[str, Any] | None = None
    ) -> None:
        """Bind every output on the device: into out[name] (a torch tensor on the device, by
        pointer) where given, else into a buffer of the shape the inputs imply, else into
        one ORT allocates."""
        import onnxruntime as ort

        out = dict(out or {})
        unknown = set(out) - {s.name for s in specs}
        if unknown:
            raise UsageError(f"output buffers for unknown outputs: {', '.join(sorted(unknown))}")
        if self.static and self._static_outputs:
            if out:
                raise UsageError("a CUDA graph runner keeps its own output buffers; pass none after the first run")
            return
        self.binding.clear_binding_outputs()
        for spec in specs:
            shape = resolve_shape(spec, dims)
            if spec.name in out:
                self._bind_output_tensor(spec, shape, out[spec.name])
            elif self.static:
                if shape is None:
                    raise UsageError(f"CUDA graphs need output {spec.name!r}'s shape from the inputs ({spec.shape})")
                ort_value = ort.OrtValue.ortvalue_from_shape_and_type(
                    shape, _ELEMENT_TYPES[spec.dtype], self.device_type, self.device_id
                )
                self._static_outputs[spec.name] = ort_value
                self.binding.bind_ortvalue_output(spec.name, ort_value)
            else:
                self.binding.bind_output(spec.name, self.device_type, self.device_id)

    def _bind_output_tensor(self, spec: TensorSpec, shape: tuple[int, ...] | None, tensor: Any) -> None:
        if not _is_torch_tensor(tensor) or not self._on_device(tensor):
            raise UsageError(
                f"output buffer {spec.name!r} must be a torch tensor on {self.device_type}:{self.device_id}"
            )
        dtype = dtype_name(tensor)
        if dtype != spec.dtype:
            raise UsageError(f"output buffer {spec.name!r} has dtype {dtype}, the model writes {spec.dtype}")
        if shape is not None and tuple(tensor.shape) != shape:
            raise UsageError(
                f"output buffer {spec.name!r} has shape {list(tensor.shape)}, the run writes {list(shape)}"
            )
        if not tensor.is_contiguous():
            raise UsageError(f"output buffer {spec.name!r} must be contiguous")
        self._keep.append(tensor)
        if self.static:
            self._static_outputs[spec.name] = tensor
        self.binding.bind_output(
            spec.name, self.device_type, self.device_id, _ELEMENT_TYPES[dtype], tuple(tensor.shape), tensor.data_ptr()
        )

    # Run ----------------------------------------------------------------------------------
    def run(self, names: list[str], out: Mapping[str, Any] | None = None) -> DeviceOutputs:
        torch = sys.modules.get("torch")
        for device in self._torch_devices:
            # torch wrote these inputs on its own stream; ORT reads them on its stream.
            torch.cuda.current_stream(device).synchronize()
        self.session.run_with_iobinding(self.binding)  # ORT synchronizes its stream at the end
        if out:
            values = {n: out[n] for n in names if n in out}
        else:
            values = {}
        if len(values) < len(names):
            ort_values = self.binding.get_outputs()
            for name, value in zip(names, ort_values):
                values.setdefault(name, value)
        return DeviceOutputs(names, values, self)

    def fetch(self) -> dict[str, np.ndarray]:
        """The outputs of the last run, copied to the host."""
        arrays = self.binding.copy_outputs_to_cpu()
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, arrays))
