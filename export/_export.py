"""torch -> ONNX through the dynamo exporter, with the contract's dynamic dims."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import logging
import os
import secrets
import warnings
from collections.abc import Iterator, Mapping

import numpy as np
import onnx
import onnx_ir as ir

import attnx.model as model_package
from attnx import __version__
from attnx._io import Staging
from attnx.errors import ExportError, UsageError, interrupt_in
from attnx.export.passes._names import NameStages
from attnx.model.config import AttentionConfig
from attnx.model.contract import (
    ATTENTION_KEY,
    CONFIG_KEY,
    EXTERNAL_DATA_THRESHOLD,
    IR_VERSION,
    LOWERINGS,
    check_opset,
    contract_dims,
)

__all__ = [
    "export_onnx",
    "save_model",
    "name_contract_dims",
    "quiet",
    "release_rewriter_state",
]

logger = logging.getLogger(__name__)

# Sizes of the example inputs the exporter traces with: none is 0 or 1 (which torch.export
# would specialise) and no two are equal (which it could unify).
EXAMPLE_BATCH, EXAMPLE_SEQ, EXAMPLE_MEM_SEQ = 2, 5, 6


@contextlib.contextmanager
def quiet() -> Iterator[io.StringIO]:
    """Hold back what the dynamo exporter prints (stdout, stderr, warnings, torch logs)."""
    buf = io.StringIO()
    loggers = [logging.getLogger(n) for n in ("torch", "torch.onnx", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield buf
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _example_inputs(config: AttentionConfig) -> tuple[tuple, dict]:
    import torch

    gen = torch.Generator().manual_seed(0)
    kwargs: dict[str, torch.Tensor] = {}
    x = torch.randn(EXAMPLE_BATCH, EXAMPLE_SEQ, config.d_model, generator=gen)
    kv_len = EXAMPLE_SEQ
    if config.cross:
        kwargs["memory"] = torch.randn(EXAMPLE_BATCH, EXAMPLE_MEM_SEQ, config.kv_dim, generator=gen)
        kv_len = EXAMPLE_MEM_SEQ
    if config.key_padding_mask:
        kwargs["key_padding_mask"] = torch.zeros(EXAMPLE_BATCH, kv_len, dtype=torch.bool)
    if config.rope is not None:
        # Distinct positions per element (a left-padded second one), so no value is taken as constant.
        positions = torch.arange(EXAMPLE_SEQ, dtype=torch.int64).repeat(EXAMPLE_BATCH, 1)
        kwargs["position_ids"] = positions - torch.arange(EXAMPLE_BATCH, dtype=torch.int64)[:, None].clamp(max=1)
    return (x,), kwargs


def _dynamic_shapes(config: AttentionConfig) -> dict[str, dict[int, object]]:
    from torch.export import Dim

    dims = {name: Dim(name) for name in ("batch", "seq", "mem_seq")}
    shapes: dict[str, dict[int, object]] = {}
    for spec in config.inputs():
        shapes[spec.name] = {axis: dims[d] for axis, d in enumerate(spec.shape) if isinstance(d, str)}
    return shapes


def export_onnx(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray] | None = None,
    *,
    seed: int = 0,
    attention: str = "decomposed",
    opset: int | None = None,
) -> ir.Model:
    """Export the attnx module for `config` to an onnx-ir Model with dynamic batch/seq: the
    decomposed full-sequence form, traced from PyTorch (the other lowerings and forms are written
    from the registry: attnx.export.build_model). The decomposed core's emitter writes the same
    graph (build_decomposed_model: same I/O, stages and outputs, tested); why both stay:
    docs/concepts/lowerings.md, "Two builders of the decomposed graph".

    A process that exports the same model again (the same config, weights, lowering and opset)
    gets a fresh copy of the first trace (TRACES), and so does the next process where
    $ATTNX_TRACE_CACHE names a folder: tracing dominates the export of a small model (measurements/build_paths).
    """
    if attention not in LOWERINGS or not LOWERINGS[attention].traced:
        raise UsageError(f"export_onnx traces the decomposed form; {attention!r} is written by attnx.export.build_model")
    if config.kv_cache:
        raise UsageError("export_onnx traces the full-sequence model; a step model is written by build_model")
    opset = check_opset(attention, opset)
    key = TRACES.key(config, weights, seed, attention, opset)
    if (model := TRACES.get(key)) is not None:
        return model
    import torch

    from attnx.model.module import build_module

    module = build_module(config, weights, seed=seed, core=LOWERINGS[attention].torch_core)
    args, kwargs = _example_inputs(config)
    logger.info("exporting %s attention at opset %d", attention, opset)
    with quiet() as log, torch.inference_mode(False), torch.no_grad():
        try:
            program = torch.onnx.export(
                module,
                args,
                kwargs=kwargs,
                dynamic_shapes=_dynamic_shapes(config),
                input_names=config.input_names(),
                output_names=["y"],
                opset_version=opset,
                dynamo=True,
                optimize=True,
            )
        except Exception as e:
            interrupt = interrupt_in(e)
            if interrupt is not None:  # Ctrl-C or SIGTERM inside the exporter, which wrapped it
                raise interrupt from None
            logger.debug("exporter output:\n%s", log.getvalue())
            raise ExportError(f"torch.onnx.export failed: {str(e).strip().splitlines()[0]}") from e
    model = program.model
    name_contract_dims(model, config)
    model.ir_version = IR_VERSION
    model.producer_name = "attnx"
    model.producer_version = __version__  # not the exporter's torch version
    model.metadata_props[CONFIG_KEY] = config.to_json()
    model.metadata_props[ATTENTION_KEY] = attention
    NameStages()(model)  # the formula's names for the exporter's val_5, linear_1 (docs/reference/onnx-graph.md, "Names")
    release_rewriter_state()
    TRACES.put(key, model)
    return model


TRACE_CACHE_ENV = "ATTNX_TRACE_CACHE"


class TraceCache:
    """Exports this process made, as serialized protos (a copy is handed out each time: graph
    passes work in place), newest last, within `max_bytes`. A model whose weights pass a quarter
    of it is neither hashed nor kept: a large model is exported once per command anyway.

    With $ATTNX_TRACE_CACHE naming a folder, traces are also kept there, one `<key>.onnx` each,
    for the next process (docs/how-to/export.md, "Reusing traces"): the key holds the versions of
    torch, onnxscript and onnx-ir and a digest of attnx's model/ and export/ sources, so a changed
    exporter or formula never meets an old trace. Every trace, cached or not, is checked by the
    export against the reference as before. Nothing is evicted from the folder."""

    def __init__(self, max_bytes: int = 128 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._protos: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._sources: str | None = None

    def key(self, config: AttentionConfig, weights: Mapping[str, np.ndarray] | None, seed: int, attention: str,
            opset: int) -> str | None:  # fmt: skip
        """What decides the trace: the config, the weights (or the seed that draws them), the
        lowering, the opset, and the code that traces (versions, attnx's sources). None: not cached."""
        digest = hashlib.sha256(f"{config.to_json()}|{attention}|{opset}|{self._code()}".encode())
        if weights is None:
            digest.update(f"|seed {seed}".encode())
        else:
            arrays = {name: np.ascontiguousarray(weights[name]) for name in sorted(weights)}
            if sum(a.nbytes for a in arrays.values()) > self.max_bytes // 4:
                return None
            for name, a in arrays.items():
                digest.update(f"|{name} {a.dtype} {a.shape}".encode())
                digest.update(a.tobytes())
        return digest.hexdigest()

    def _code(self) -> str:
        """The versions of what traces, and a digest of the sources that define the module and the graph."""
        if self._sources is None:
            from importlib.metadata import version

            digest = hashlib.sha256(__version__.encode())
            for package in ("torch", "onnxscript", "onnx-ir", "onnx"):
                digest.update(f"|{package} {version(package)}".encode())
            for folder in (os.path.dirname(model_package.__file__), os.path.dirname(__file__)):
                for root, dirs, files in os.walk(folder):
                    dirs.sort()
                    for name in sorted(f for f in files if f.endswith(".py")):
                        with open(os.path.join(root, name), "rb") as f:
                            digest.update(name.encode() + b"\0" + f.read())
            self._sources = digest.hexdigest()
        return self._sources

    @staticmethod
    def folder() -> str | None:
        return os.environ.get(TRACE_CACHE_ENV) or None

    def get(self, key: str | None) -> ir.Model | None:
        if key is None:
            return None
        if key in self._protos:
            self._protos.move_to_end(key)
            data = self._protos[key]
        elif (folder := self.folder()) is not None and os.path.isfile(path := os.path.join(folder, f"{key}.onnx")):
            with open(path, "rb") as f:
                data = f.read()
            logger.info("reusing the trace %s", path)
        else:
            return None
        return ir.serde.deserialize_model(onnx.ModelProto.FromString(data))

    def put(self, key: str | None, model: ir.Model) -> None:
        if key is None:
            return
        data = ir.serde.serialize_model(model).SerializeToString()
        if len(data) > self.max_bytes:
            return
        self._protos[key] = data
        while sum(map(len, self._protos.values())) > self.max_bytes:
            self._protos.popitem(last=False)
        if (folder := self.folder()) is not None:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{key}.onnx")
            partial = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.partial"  # another process may read it meanwhile
            try:
                with open(partial, "wb") as f:
                    f.write(data)
                os.replace(partial, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(partial)

    def clear(self) -> None:
        self._protos.clear()


TRACES = TraceCache()


def release_rewriter_state() -> None:
    """Drop the graph that onnxscript's module-level rewrite rules keep from their last match.

    The exporter's optimizer (and the ORT fusion rules of the graph passes) match with rule
    objects held in module globals, and each matcher keeps the last graph it looked at
    (_graph, _current_node, _match): through it, every initializer of the exported model,
    the weights included (2.4 GB for the gpt3 preset), stays alive after the model is saved
    and deleted. Matchers set this state afresh at the start of every match.

    The matchers are found from onnxscript's modules (_rule_matchers), not by a scan of every live
    object: in a long-lived process (a test worker) that scan cost 0.5-1 s an export
    (measurements/ci_time). tests/export/test_export.py scans every object to prove none is missed.
    """
    try:
        from onnxscript.rewriter._basics import MatchResult
    except ImportError:  # another onnxscript layout: nothing known to release
        return
    for matcher in _rule_matchers():
        for attr in ("_graph", "_current_node", "_tracer"):
            if hasattr(matcher, attr):
                setattr(matcher, attr, None)
        if hasattr(matcher, "_match"):
            matcher._match = MatchResult()


_MATCHERS: tuple[int, list[object]] = (-1, [])  # (len(sys.modules) when found, the matchers)


def _rule_matchers() -> list[object]:
    """The matchers of the rewrite rules onnxscript's modules hold in their globals: a rule, a rule set, or a
    list, tuple or dict of them; found again whenever a module was imported since the last time."""
    import sys
    import types

    global _MATCHERS
    if _MATCHERS[0] == len(sys.modules):
        return _MATCHERS[1]
    try:
        from onnxscript.rewriter._rewrite_rule import RewriteRule, RewriteRuleSet
    except ImportError:
        return []
    found: dict[int, object] = {}

    def visit(value: object, depth: int) -> None:
        if isinstance(value, RewriteRule):
            matcher = getattr(value, "_matcher", None)
            if matcher is not None:
                found[id(matcher)] = matcher
        elif isinstance(value, RewriteRuleSet):
            for rule in value.rules:
                visit(rule, depth + 1)
        elif depth < 2 and isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                visit(item, depth + 1)
        elif depth < 2 and isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)

    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("onnxscript"):
            continue
        for value in list(vars(module).values()):
            if not isinstance(value, (types.ModuleType, type, types.FunctionType)):
                visit(value, 0)
    _MATCHERS = (len(sys.modules), list(found.values()))
    return _MATCHERS[1]


def name_contract_dims(model: ir.Model, config: AttentionConfig) -> None:
    """Check that every dynamic dim of the graph's inputs and outputs is symbolic and give
    it its contract name everywhere in the graph.

    An exporter that specialised a dim (wrote a number where the contract has batch, seq or
    mem_seq) produced a model that only runs at one size: that is an error, not a warning.
    The exporter may name a dim s77 instead of seq; the symbol is renamed, consistently.
    """
    expected = contract_dims(config)
    graph_values = {v.name: v for v in [*model.graph.inputs, *model.graph.outputs]}
    if set(graph_values) != set(expected):
        raise ExportError(f"exported graph has inputs/outputs {sorted(graph_values)}, expected {sorted(expected)}")
    rename: dict[str, str] = {}
    for name, dims in expected.items():
        shape = graph_values[name].shape
        if shape is None or len(shape) != len(dims):
            raise ExportError(f"exported {name!r} has shape {shape}, expected {dims}")
        for axis, (got, want) in enumerate(zip(shape, dims)):
            if isinstance(want, int):
                if got != want:
                    raise ExportError(f"exported {name!r} has size {got} on axis {axis}, expected {want}")
                continue
            if isinstance(got, int):
                raise ExportError(f"the export specialised dim {want!r} of {name!r} (axis {axis}) to {got}")
            symbol = got.value
            if symbol is None:
                raise ExportError(f"dim {want!r} of {name!r} (axis {axis}) came out unnamed")
            if rename.setdefault(symbol, want) != want:
                raise ExportError(
                    f"the export unified dims {rename[symbol]!r} and {want!r} into one symbol {symbol!r}"
                )
    for value in _all_values(model.graph):
        if value.shape is None:
            continue
        dims = [ir.SymbolicDim(rename.get(d.value, d.value)) if isinstance(d, ir.SymbolicDim) else d for d in value.shape]
        if any(isinstance(d, ir.SymbolicDim) and d.value in rename for d in value.shape):
            value.shape = ir.Shape(dims)


def _all_values(graph: ir.Graph) -> Iterator[ir.Value]:
    yield from graph.inputs
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from node.outputs


def initializer_bytes(model: ir.Model) -> int:
    """The bytes of every initializer of the model and its subgraphs (from dtype and shape: external data is not
    read)."""
    tensors = [v.const_value for g in model.graphs() for v in g.initializers.values()]
    return sum(t.nbytes for t in tensors if t is not None)


def _external_tensors(model: ir.Model) -> list[ir.ExternalTensor]:
    return [v.const_value for g in model.graphs() for v in g.initializers.values()
            if isinstance(v.const_value, ir.ExternalTensor)]  # fmt: skip


def _check_one_file(model: ir.Model, target: str) -> None:
    """external_data=False: what is embedded fits one protobuf file, and the tensors kept in their data file are
    in the one their location names beside `target`, inside its folder (else the written model would point at
    another file or none)."""
    embedded = initializer_bytes(model) - sum(t.nbytes for t in _external_tensors(model))
    if embedded > EXTERNAL_DATA_THRESHOLD:
        raise ExportError(f"cannot write {target!r} as one file: its tensors hold {embedded} bytes, past "
                          f"{EXTERNAL_DATA_THRESHOLD} (protobuf's 2 GiB limit); save it with external data")
    folder = os.path.dirname(os.path.realpath(target))
    for tensor in _external_tensors(model):
        held = os.path.realpath(tensor.path)
        beside = os.path.realpath(os.path.join(folder, tensor.location))
        if held != beside or os.path.commonpath([folder, beside]) != folder:
            raise ExportError(f"cannot keep tensor {tensor.name!r} in its data file {held!r}: {target!r} would read "
                              f"it at {beside!r}; save with external_data=True to write a data file of its own")  # fmt: skip


def _ordinary_mode(path: str) -> None:
    """onnx-ir writes a data file through a private temporary file (mode 0600): the mode an ordinary new file has."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_model(model: ir.Model, path: str | os.PathLike[str], *, external_data: bool | None = None) -> list[str]:
    """Write `model` at `path`, the one way attnx writes an onnx-ir model; returns the files written.

    Atomic: the model (and its data file) written in a staging folder beside `path`, then renamed into place
    (attnx._io.Staging); a failure leaves `path` as it was. IR version IR_VERSION (attnx.model.contract).
    external_data None: one data file `<name>.data` beside the model (relative location, an ordinary file's mode)
    where any initializer is already in a data file (a model read back from disk, another tool's) or the
    initializers pass EXTERNAL_DATA_THRESHOLD (protobuf's 2 GiB, less room for the graph); else one file.
    True: the data file always. False: no data file of its own: tensors in memory are embedded, those already in
    a data file are kept where they are, which must be beside `path` (a second model sharing the first's data,
    the buffer form's decode.onnx). The tensors are written one at a time (onnx-ir's save).
    """
    model.ir_version = IR_VERSION
    if external_data is None:
        external_data = bool(_external_tensors(model)) or initializer_bytes(model) > EXTERNAL_DATA_THRESHOLD
    elif not external_data:
        _check_one_file(model, os.path.abspath(os.fspath(path)))
    with Staging(path) as stage:
        data = f"{stage.name}.data" if external_data else None
        ir.save(model, stage.path(), external_data=data)
        if data is not None and os.path.exists(stage.path(data)):  # none where every tensor is small
            _ordinary_mode(stage.path(data))
        return stage.publish()
