"""The Runner interface and the backend registry.

As Polygraphy's BaseRunner: public load/run/close do the shared work (state checks, feed
validation against the input metadata), backends override the *_impl hooks. Runners are
context managers. No torch import here: a deployment machine may have none.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from attnx.errors import InputError, UsageError
from attnx.model.config import AttentionConfig, TensorSpec
from attnx.model.contract import DTYPES, dtype_name

__all__ = [
    "ModelSource",
    "Runner",
    "register_backend",
    "create_runner",
    "backend_names",
    "backend_unavailable_reason",
    "RUNNERS",
    "DecodeState",
    "THREADS_ENV",
    "runtime_threads",
    "time_runner",
]

logger = logging.getLogger(__name__)

# The threads each runtime session attnx opens may use (ONNX Runtime's intra-op pool, OpenVINO's
# INFERENCE_NUM_THREADS), when a caller gives none: on a shared host, or beside other processes
# (the tests on every core), a session that takes every core and spins between runs slows all.
THREADS_ENV = "ATTNX_THREADS"


def runtime_threads(threads: int | None = None) -> int | None:
    """`threads` when given, else ATTNX_THREADS when set (a positive integer, or one UsageError
    naming the variable), else None: the runtime's own default (every core)."""
    if threads is not None:
        return threads
    text = os.environ.get(THREADS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{THREADS_ENV}={text!r}: expected a positive integer (threads per runtime session)")
    return int(text)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What a backend builds its runner from: the config and weights (torch, reference)
    or an ONNX file (ort-*). dtype is the compute dtype of the model."""

    config: AttentionConfig | None = None
    weights: Mapping[str, np.ndarray] | None = None
    model_path: str | None = None
    dtype: str = "fp32"


@dataclasses.dataclass
class DecodeState:
    """Where a decode stands after a prefill or a step of a step model (config kv_cache).

    y: the output of that run, [batch, seq, d_model]; cache: the cache to feed next, one value per tensor of the
    config's cache_specs (past_key and past_value; past_latent for a latent config), as numpy arrays or a backend's
    own buffers (ORT OrtValues, which stay in ORT's memory); key_padding_mask: the mask of every position so far
    (None when the model takes none); length: total_seq so far."""

    y: np.ndarray
    cache: tuple[Any, ...]
    key_padding_mask: np.ndarray | None
    length: int

    @property
    def past_key(self) -> Any:
        return self.cache[0]

    @property
    def past_value(self) -> Any:
        return self.cache[1]

    def cache_numpy(self) -> tuple[np.ndarray, ...]:
        """The cache as numpy arrays (a copy out of the backend's buffers where it holds them)."""
        return tuple(_as_numpy(value) for value in self.cache)


def _as_numpy(value: Any) -> np.ndarray:
    return np.asarray(value) if isinstance(value, np.ndarray) or not hasattr(value, "numpy") else value.numpy()


class Runner:
    """Base of every backend. Subclasses set `name` and implement the *_impl hooks.

    contract: whether the model follows attnx's ONNX contract (DESIGN section 4: dims named batch, seq,
    past_seq, total_seq, ...): a model attnx wrote says so in its metadata (attnx.config), and a
    backend that reads a model file sets it from there at load; the torch and reference runners build
    attnx's own model. A model another tool wrote (the audit's cut of one) names its dims as its
    exporter did: its feeds are held to its declared names, ranks, dtypes and fixed dims alone, and
    the runtime judges the rest (check_feeds)."""

    name: str = "runner"

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.is_loaded = False
        self.contract = True
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

    # Decoding (a step model: config kv_cache) ------------------------------------------------
    def prefill(
        self, x: Any, key_padding_mask: np.ndarray | None = None, position_ids: np.ndarray | None = None
    ) -> DecodeState:
        """Run the prompt x [batch, P, d_model] on an empty cache (past_seq 0); the state holds
        its output y and the cache. key_padding_mask [batch, P]: True hides (left padding).
        position_ids int64 [batch, P]: each token's position, for a model with rope (step())."""
        config = self._step_config()
        batch = x.shape[0]
        dtype = self._float_dtype()
        empty = tuple(np.zeros((batch, *spec.shape[1:2], 0, *spec.shape[3:]), dtype) for spec in config.cache_specs())
        mask = np.zeros((batch, 0), bool) if config.key_padding_mask else None
        _, state = self.step(x, DecodeState(np.zeros((batch, 0, config.d_model)), empty, mask, 0),
                             key_padding_mask, position_ids)  # fmt: skip
        return state

    def step(
        self,
        x: Any,
        state: DecodeState,
        key_padding_mask: np.ndarray | None = None,
        position_ids: np.ndarray | None = None,
    ) -> tuple[np.ndarray, DecodeState]:
        """y of the new tokens x [batch, seq, d_model] at token indices state.length.., and the
        state after them (the present cache fed back as past). key_padding_mask [batch, seq]: True
        hides these tokens (default: none hidden). position_ids int64 [batch, seq], for a model
        with rope: the tokens' positions (Hugging Face's position_ids; required there, refused
        elsewhere: a left-padded row's positions are not its token indices)."""
        config = self._step_config()
        if not self.is_loaded:
            raise UsageError(f"runner {self.name!r} is not loaded: call load() or use it as a context manager")
        past = [spec.name for spec in config.cache_specs()]  # past_key, past_value; past_latent
        feeds: dict[str, Any] = {"x": x, **dict(zip(past, state.cache))}
        mask = None
        if config.key_padding_mask:
            new = np.zeros(tuple(x.shape[:2]), bool) if key_padding_mask is None else np.asarray(key_padding_mask)
            if new.dtype != np.bool_ or new.shape != tuple(x.shape[:2]):
                raise InputError(
                    f"key_padding_mask of a step must be bool {list(x.shape[:2])} (batch, seq of x), "
                    f"got {new.dtype} {list(new.shape)}"
                )
            mask = np.concatenate([state.key_padding_mask, new], axis=1)  # [batch, total_seq]
            feeds["key_padding_mask"] = mask
        elif key_padding_mask is not None:
            raise InputError("this model takes no key_padding_mask")
        if config.rope is not None:
            if position_ids is None:
                raise InputError("this model has rope: each step takes position_ids int64 [batch, seq]")
            feeds["position_ids"] = position_ids
        elif position_ids is not None:
            raise InputError("this model takes no position_ids (its config has no rope)")
        out = self.run_step_impl(feeds)
        y = _as_numpy(out["y"])
        present = tuple(out[spec.name] for spec in config.cache_specs(prefix="present_"))
        return y, DecodeState(y, present, mask, state.length + int(x.shape[1]))

    def run_step_impl(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One run of the step model. Default: the cache as numpy arrays in the model's input dtype
        (the float64 reference's cache is fed back as the float32 its inputs declare)."""
        dtype = self._float_dtype()
        feeds = dict(feeds)
        for spec in self._step_config().cache_specs():
            feeds[spec.name] = _as_numpy(feeds[spec.name]).astype(dtype, copy=False)
        return self.run(feeds)

    def _step_config(self) -> AttentionConfig:
        config = self.source.config
        if config is None or not config.kv_cache:
            raise UsageError(
                f"prefill/step need a step model (a config with 'kv_cache': true); backend {self.name!r} runs "
                + ("a model without a cache" if config is not None else "a model without a config")
            )
        if any(s.name == "seqlens_k" for s in self.inputs):
            raise UsageError(
                "this step model is the buffer form (one cache bound as past and present): decode it with "
                "attnx.runtimes.decode.BufferDecoder; prefill/step run the growing form"
            )
        return config

    def _float_dtype(self) -> np.dtype:
        config = self.source.config
        caches = {spec.name for spec in config.cache_specs()} if config is not None and config.kv_cache else set()
        spec = next((s for s in self.inputs if s.name in caches), None)  # the cache's first tensor, as its core lays it
        name = spec.dtype if spec is not None else self.source.dtype
        return np.dtype(DTYPES[name].numpy or "float32")

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
    def fixed_dims_mismatch(self, feeds: Mapping[str, Any]) -> str | None:
        """The first feed of a size the model's fixed dims do not allow (a batch fixed at 1 fed 3 rows), said as
        check_feeds says it, or None: a case the model's own dims rule out (parity skips it, not applicable)."""
        for spec in self.inputs:
            value = feeds.get(spec.name)
            if value is None or len(value.shape) != len(spec.shape):
                continue
            for axis, (dim, size) in enumerate(zip(spec.shape, value.shape)):
                if isinstance(dim, int) and size != dim:
                    return f"input {spec.name!r} has size {size} on axis {axis}, expected {dim} {_shape_str(spec.shape)}"
        return None

    def check_feeds(self, feeds: Mapping[str, Any]) -> None:
        """Raise one InputError naming the first bad feed: name, rank, dtype, fixed dims; and, in a
        model that follows attnx's contract (self.contract), symbolic dims that must agree between
        inputs (batch, and the key length) and no empty axis but the past's."""
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
            # ONNX Runtime lists an input of unknown rank as [] (a cut of another tool's model has them)
            if len(shape) != len(spec.shape) and (self.contract or spec.shape):
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
                        raise InputError(self.fixed_dims_mismatch({spec.name: value}))
                    continue
                if not self.contract:  # its dims' names are its exporter's (the class doc)
                    continue
                if size == 0 and dim != "past_seq":  # an empty cache is the prefill
                    raise InputError(f"input {spec.name!r} has an empty axis {axis} ({dim})")
                if dim in bound and bound[dim][0] != size:
                    other_size, other = bound[dim]
                    raise InputError(
                        f"input {spec.name!r} has {dim}={size} on axis {axis}, but {other!r} has {dim}={other_size}"
                    )
                bound.setdefault(dim, (size, spec.name))
        if {"past_seq", "seq", "total_seq"} <= set(bound):  # a step model's mask covers every position
            (past, _), (seq, _), (total, name) = bound["past_seq"], bound["seq"], bound["total_seq"]
            if total != past + seq:
                raise InputError(
                    f"input {name!r} covers {total} positions; past_seq {past} + seq {seq} = {past + seq} expected"
                )


def _shape_str(shape: tuple[int | str, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# Registry ----------------------------------------------------------------------------
# Each backend's runner class by its name (the names: attnx.model.contract.BACKEND_NAMES).
RUNNERS: dict[str, Callable[[ModelSource], Runner]] = {}


def register_backend(name: str) -> Callable[[type[Runner]], type[Runner]]:
    def wrap(cls: type[Runner]) -> type[Runner]:
        cls.name = name
        RUNNERS[name] = cls
        return cls

    return wrap


def backend_names() -> list[str]:
    return list(RUNNERS)


def backend_unavailable_reason(name: str) -> str | None:
    """Why the registered backend `name` cannot run here, or None when it can (see
    Runner.unavailable_reason)."""
    if name not in RUNNERS:
        raise UsageError(f"unknown backend {name!r} (known: {', '.join(RUNNERS)})")
    return RUNNERS[name].unavailable_reason()


def create_runner(name: str, source: ModelSource, **options: Any) -> Runner:
    """A runner for a registered backend (not yet loaded), with the backend's own keyword
    options (threads, session_options for ort-*; attention for torch*). load() raises
    ProviderUnavailable with the reason where the backend cannot run here."""
    if name not in RUNNERS:
        raise UsageError(f"unknown backend {name!r} (known: {', '.join(RUNNERS)})")
    return RUNNERS[name](source, **options)


def require_source(runner: Runner, *, config: bool = False, weights: bool = False, model_path: bool = False) -> None:
    s = runner.source
    if config and s.config is None:
        raise UsageError(f"backend {runner.name!r} needs a config")
    if weights and s.weights is None:
        raise UsageError(f"backend {runner.name!r} needs weights")
    if model_path and s.model_path is None:
        raise UsageError(f"backend {runner.name!r} needs an ONNX model (--model)")


__all__ += ["require_source"]


def time_runner(runner: Runner, feeds: Mapping[str, np.ndarray], repeat: int = 5) -> float:
    """Median milliseconds of `repeat` runs of a loaded runner after one warm-up, timed around run only."""
    runner.run(feeds)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        runner.run(feeds)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)
