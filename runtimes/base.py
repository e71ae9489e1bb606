"""The Runner interface and the backend registry.

As Polygraphy's BaseRunner: public load/run/close do the shared work (state checks, feed
validation against the input metadata), backends override the *_impl hooks. Runners are
context managers. No torch import here: a deployment machine may have none.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.errors import InputError, UsageError
from attnx.model.config import AttentionConfig, TensorSpec
from attnx.model.contract import dtype_name

__all__ = [
    "ModelSource",
    "Runner",
    "register_backend",
    "create_runner",
    "backend_names",
    "backend_unavailable_reason",
    "BACKENDS",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a backend builds its runner from: the config and weights (torch, reference)
    or an ONNX file (ort-*). dtype is the compute dtype of the model."""

    config: AttentionConfig | None = None
    weights: Mapping[str, np.ndarray] | None = None
    model_path: str | None = None
    dtype: str = "fp32"


class Runner:
    """Base of every backend. Subclasses set `name` and implement the *_impl hooks."""

    name: str = "runner"

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.is_loaded = False
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []

    # Public API ---------------------------------------------------------------------
    def load(self) -> Runner:
        if not self.is_loaded:
            self.load_impl()
            self.is_loaded = True
        return self

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.is_loaded:
            raise UsageError(f"runner {self.name!r} is not loaded: call load() or use it as a context manager")
        self.check_feeds(feeds)
        return self.run_impl(feeds)

    def close(self) -> None:
        if self.is_loaded:
            self.close_impl()
            self.is_loaded = False

    def __enter__(self) -> Runner:
        return self.load()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine at all (a library or a device is
        missing), or None when it may: a cheap probe, without a model. load() still checks."""
        return None

    # Hooks --------------------------------------------------------------------------
    def load_impl(self) -> None:
        raise NotImplementedError

    def run_impl(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def close_impl(self) -> None:
        pass

    # Shared work ----------------------------------------------------------------------
    def check_feeds(self, feeds: Mapping[str, Any]) -> None:
        """Raise one InputError naming the first bad feed: name, rank, dtype, fixed dims,
        and symbolic dims that must agree between inputs (batch, and the key length)."""
        expected = {spec.name: spec for spec in self.inputs}
        for name in feeds:
            if name not in expected:
                raise InputError(f"unexpected input {name!r} (this model takes: {', '.join(expected)})")
        bound: dict[str, tuple[int, str]] = {}
        for spec in self.inputs:
            if spec.name not in feeds:
                raise InputError(f"missing input {spec.name!r} (this model takes: {', '.join(expected)})")
            value = feeds[spec.name]
            shape = tuple(value.shape)
            if len(shape) != len(spec.shape):
                raise InputError(
                    f"input {spec.name!r} has rank {len(shape)} (shape {list(shape)}), expected rank "
                    f"{len(spec.shape)} {_shape_str(spec.shape)}"
                )
            got_dtype = dtype_name(value)
            if got_dtype != spec.dtype:
                raise InputError(f"input {spec.name!r} has dtype {got_dtype}, expected {spec.dtype}")
            for axis, (dim, size) in enumerate(zip(spec.shape, shape)):
                if isinstance(dim, int):
                    if size != dim:
                        raise InputError(
                            f"input {spec.name!r} has size {size} on axis {axis}, expected {dim} {_shape_str(spec.shape)}"
                        )
                    continue
                if size == 0 and dim != "past_seq":  # an empty cache is the prefill
                    raise InputError(f"input {spec.name!r} has an empty axis {axis} ({dim})")
                if dim in bound and bound[dim][0] != size:
                    other_size, other = bound[dim]
                    raise InputError(
                        f"input {spec.name!r} has {dim}={size} on axis {axis}, but {other!r} has {dim}={other_size}"
                    )
                bound.setdefault(dim, (size, spec.name))


def _shape_str(shape: tuple[int | str, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# Registry ----------------------------------------------------------------------------
BACKENDS: dict[str, Callable[[ModelSource], Runner]] = {}


def register_backend(name: str) -> Callable[[type[Runner]], type[Runner]]:
    def wrap(cls: type[Runner]) -> type[Runner]:
        cls.name = name
        BACKENDS[name] = cls
        return cls

    return wrap


def backend_names() -> list[str]:
    return list(BACKENDS)


def backend_unavailable_reason(name: str) -> str | None:
    """Why the registered backend `name` cannot run here, or None when it can (see
    Runner.unavailable_reason)."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    return BACKENDS[name].unavailable_reason()


def create_runner(name: str, source: ModelSource, **options: Any) -> Runner:
    """A runner for a registered backend (not yet loaded), with the backend's own keyword
    options (threads, session_options for ort-*; attention for torch*). load() raises
    ProviderUnavailable with the reason where the backend cannot run here."""
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r} (known: {', '.join(BACKENDS)})")
    return BACKENDS[name](source, **options)


def require_source(runner: Runner, *, config: bool = False, weights: bool = False, model_path: bool = False) -> None:
    s = runner.source
    if config and s.config is None:
        raise UsageError(f"backend {runner.name!r} needs a config")
    if weights and s.weights is None:
        raise UsageError(f"backend {runner.name!r} needs weights")
    if model_path and s.model_path is None:
        raise UsageError(f"backend {runner.name!r} needs an ONNX model (--model)")


__all__ += ["require_source"]
