"""`attnx audit`: the attention blocks of a whole model another tool exported, each read back
(attnx.export._blocks), cut out of the graph at its own tensors, run on ONNX Runtime and held
against attnx's float64 reference; with a Hugging Face checkpoint, each block is paired with the
checkpoint's layer by its weights' values (never by names) and every term that differs is a finding.

Each block runs a full sequence longer than its window, a right-padded batch (the op's convention:
each row's length in seqlens_k), then a prefill and single-token steps through the model's own cache
inputs (past_key_values.N.*, seqlens_k, total_sequence_length): its output against the reference of the
checkpoint's layer (or, without one, of the layer read from the graph) under the tolerance table. A
MatMulNBits graph is held against the model as it computes: its dequantized weights, and at
accuracy_level 4 its projections' inputs in int8 blocks (int8_blocks). The model is untrusted input: external data is checked to lie
whole inside the model's folder before anything is read (attnx.runtimes.package.check_external_data).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from attnx.errors import UsageError
from attnx.export._blocks import iter_blocks, rope_table_error
from attnx.model.config import AttentionConfig
from attnx.model.contract import PROVIDERS
from attnx.model.importers import import_weights, read_checkpoint_config, read_q_projection
from attnx.model.reference import reference_attention
from attnx.model.rope import rope_frequencies
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes.base import runtime_threads
from attnx.runtimes.compare import Comparison, compare_arrays
from attnx.runtimes.openvino_runner import DEVICE, compile_config, openvino_unavailable_reason
from attnx.runtimes.ort_runner import ort_cuda_unavailable_reason
from attnx.runtimes.package import check_external_data

__all__ = ["AuditReport", "BlockAudit", "CheckpointLayers", "audit_model", "AUDIT_SHAPE"]

# (full-sequence tokens, prefill tokens, single steps): past an 8-token window, within a 128-row rope table;
# the padded batch's second row is `padding` tokens shorter
AUDIT_SHAPE = {"tokens": 12, "prefill": 9, "steps": 3, "batch": 2, "padding": 3}


@dataclasses.dataclass
class BlockAudit:
    index: int
    node: str
    core: str  # the registry's name of its core (attnx.model.cores)
    layer: int | None  # the checkpoint's layer it pairs with
    terms: tuple[str, ...]
    findings: list[str]
    checks: list[Comparison]
    not_checked: list[str]

    @property
    def passed(self) -> bool:
        return not self.findings and not self.not_checked and all(self.checks)

    def worst(self) -> Comparison | None:
        return max(self.checks, key=lambda c: c.max_abs / max(c.atol, 1e-30), default=None)

    def line(self) -> str:
        verdict = "pass" if self.passed else "FAIL" if (self.findings or not all(self.checks)) else "not checked"
        worst = self.worst()
        err = f"max_abs {worst.max_abs:.3g} (atol {worst.atol:.3g})" if worst is not None else "not run"
        paired = f" = checkpoint layer {self.layer}" if self.layer is not None else ""
        return f"block {self.index}{paired}: {verdict:<11} {err}  {self.core}  {','.join(self.terms)}  [{self.node}]"

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "node": self.node, "core": self.core, "layer": self.layer, "terms": list(self.terms),
                "passed": self.passed, "findings": self.findings, "not_checked": self.not_checked,
                "checks": [{"name": c.name, "passed": c.passed, "atol": c.atol, "rtol": c.rtol, **c.stats()}
                           for c in self.checks]}  # fmt: skip


@dataclasses.dataclass
class AuditReport:
    model: str
    checkpoint: str | None
    blocks: list[BlockAudit]
    unread: list[str]
    skipped: list[str] = dataclasses.field(default_factory=list)  # a backend unavailable on this machine, and why

    @property
    def passed(self) -> bool:
        return all(b.passed for b in self.blocks) and not self.unread

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "checkpoint": self.checkpoint, "passed": self.passed,
                "blocks": [b.to_dict() for b in self.blocks], "unread": self.unread,
                "skipped": self.skipped}  # fmt: skip


class CheckpointLayers:
    """A checkpoint's layers as the audit needs them, one at a time: each layer's q projection kept only as a
    sample of its rows (read alone, read_q_projection), which pairs a block with its layer by value; the
    paired layer's attention imported (import_weights) when its block is checked, and dropped after. So
    a checkpoint larger than memory is held a layer at a time, plus the samples (at most SAMPLE_ROWS rows
    of q per layer)."""

    SAMPLE_ROWS = 32

    def __init__(self, folder: str) -> None:
        hf = read_checkpoint_config(folder)
        n_layers = int(hf.get("num_hidden_layers") or hf.get("n_layer") or 0)
        self.folder = folder
        self.samples: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}  # layer -> (q's shape, its sampled rows)
        for i in range(n_layers):
            q = read_q_projection(folder, i)
            self.samples[i] = (q.shape, np.array(q[self._rows(q.shape[0])]))

    def _rows(self, n: int) -> np.ndarray:
        """The rows sampled of a q projection of n rows: all of a small one, else evenly spread."""
        return np.unique(np.linspace(0, n - 1, min(n, self.SAMPLE_ROWS)).round().astype(np.int64))

    def pair(self, q: np.ndarray) -> int | None:
        """The layer whose q projection is nearest the block's `q` (relative max difference, never names):
        on the sampled rows; layers tied there are told apart by their whole q projections."""

        def error(theirs: np.ndarray, ours: np.ndarray) -> float:
            theirs = np.asarray(theirs, np.float64)
            return float(np.abs(theirs - ours).max() / max(np.abs(theirs).max(), 1e-30))

        rows = self._rows(q.shape[0])
        ours = np.asarray(q, np.float64)[rows]
        errors = {i: error(sample, ours) for i, (shape, sample) in self.samples.items() if shape == q.shape}
        if not errors:
            return None
        best = min(errors.values())
        tied = [i for i, e in errors.items() if e <= best]
        if len(tied) == 1 or len(rows) == q.shape[0]:
            return tied[0]
        whole = np.asarray(q, np.float64)
        return min(tied, key=lambda i: error(read_q_projection(self.folder, i), whole))

    def layer(self, i: int) -> Any:
        """Layer i's attention, imported now (an ImportResult)."""
        return import_weights(self.folder, layer=i)


def _compare_terms(block: Any, config: AttentionConfig, weights: dict[str, np.ndarray], layer: int) -> list[str]:
    """Every difference between the formula the graph states and the checkpoint layer's, by term."""
    g, facts, found = block.config, block.facts, []
    where = f"layer {layer}"
    for key in ("n_heads", "n_kv_heads", "head_dim"):
        if getattr(g, key) != getattr(config, key):
            found.append(f"{where}: {key} {getattr(g, key)} in the graph, {getattr(config, key)} in the checkpoint")
    if not np.isclose(g.softmax_scale, config.softmax_scale, rtol=1e-6):
        found.append(f"{where}: scale {g.softmax_scale:.6g} in the graph, {config.softmax_scale:.6g} in the checkpoint")
    if (g.softcap or None) != (config.softcap or None) and not (
        g.softcap and config.softcap and np.isclose(g.softcap, config.softcap, rtol=1e-6)
    ):
        found.append(f"{where}: softcap {g.softcap} in the graph, {config.softcap} in the checkpoint")
    if g.sliding_window != config.sliding_window:
        graph_says = (f"window {g.sliding_window} in the graph (local_window_size {facts.get('local_window_size')})"
                      if g.sliding_window else
                      f"no window in the graph (local_window_size {facts.get('local_window_size', -1)})")  # fmt: skip
        ckpt = f"sliding_window {config.sliding_window}" if config.sliding_window else "no window"
        found.append(f"{where}: {graph_says}, {ckpt} in the checkpoint"
                     + (f": every query past {config.sliding_window} sees keys it must not"
                        if config.sliding_window and not g.sliding_window else ""))  # fmt: skip
    if g.sinks != config.sinks:
        found.append(f"{where}: sinks {'in the graph' if g.sinks else 'missing from the graph'}, "
                     f"{'in' if config.sinks else 'not in'} the checkpoint")  # fmt: skip
    if (g.qk_norm is None) != (config.qk_norm is None):
        found.append(f"{where}: q/k norm {'in the graph' if g.qk_norm else 'missing from the graph'}, "
                     f"{'in' if config.qk_norm else 'not in'} the checkpoint")  # fmt: skip
    if config.rope is not None:
        tables = facts.get("rope_tables")
        if tables is None:
            found.append(f"{where}: no rotary in the graph, rope in the checkpoint")
        else:
            cos, sin = tables
            inv_freq, factor = rope_frequencies(config.rope, cos.shape[0])
            err, ratio = rope_table_error(cos, sin, inv_freq, factor)
            if ratio > 1:  # beyond float32's rounding of the angles (rope_table_error)
                found.append(f"{where}: rotary table differs from the checkpoint's rope ({config.rope.rope_type}, "
                             f"theta {config.rope.theta:g}) by {err:.3g}, {ratio:.3g} times its bound (graph theta "
                             f"fit {facts.get('rope_theta', float('nan')):.6g})")  # fmt: skip
            if block.facts.get("rotary_interleaved") != config.rope.interleaved:
                found.append(f"{where}: rotary_interleaved {int(block.facts.get('rotary_interleaved', 0))} in the graph, "
                             f"the checkpoint's rope pairs {'(2i, 2i+1)' if config.rope.interleaved else '(i, i+dim/2)'}")  # fmt: skip
    # weights: the graph's (dequantized where quantized) against the checkpoint's
    quantized = block.quantization is not None
    for name, theirs in weights.items():
        ours = block.weights.get(name)
        if ours is None:
            if name == "sinks" and not g.sinks:
                continue  # said above, as the term
            if np.any(theirs):
                found.append(f"{where}: {name} is in the checkpoint, not in the graph")
            continue
        if ours.shape != theirs.shape:
            found.append(f"{where}: {name} shape {list(ours.shape)} in the graph, {list(theirs.shape)} in the checkpoint")
            continue
        ref = np.asarray(theirs, np.float64)
        diff = np.abs(ours - ref)
        if quantized and name.endswith("_proj.weight"):
            # 4-bit blocks along the input: each weight within one step of its block (|w| max of the block / 7)
            n = int(block.quantization.get("block_size", 32))
            step = np.repeat(_blocks_of(np.abs(ref), n).max(axis=2) / 7, n, axis=1)[:, : ref.shape[1]]
            bad = diff > step * (1 + 1e-3) + 1e-12
            if bad.any():
                r, k = np.argwhere(bad)[0]
                found.append(f"{where}: {name} differs from the checkpoint's by more than its 4-bit step in "
                             f"{int(bad.sum())} weight(s), first [{r}, {k}] (block {k // n})")  # fmt: skip
            continue
        err = float(diff.max() / max(np.abs(ref).max(), 1e-30))
        if err > 1e-5:  # float32 storage of the checkpoint's values: a few ulps
            found.append(f"{where}: {name} differs from the checkpoint's by {err:.3g} of its largest value")
    return found


def _cut(extractor: Any, block: Any, base_dir: str) -> bytes:
    """The block as a model of its own: the graph's nodes between its boundary tensors (onnx's Extractor over
    the whole graph, typed once), with only their own tensors' external data read (the graph has none)."""
    from onnx.external_data_helper import load_external_data_for_model

    names = [block.inputs[k] for k in ("x", "seqlens_k", "total_sequence_length", "past_key", "past_value")
             if k in block.inputs]  # fmt: skip
    outs = [block.outputs[k] for k in ("y", "present_key", "present_value")]
    cut = extractor.extract_model(names, outs)
    for value in cut.graph.input:  # a scalar (GroupQueryAttention's schema); shape inference may leave it unranked
        if value.name == block.inputs.get("total_sequence_length"):
            value.type.tensor_type.shape.Clear()
    load_external_data_for_model(cut, base_dir)
    return cut.SerializeToString()


Run = Callable[[dict[str, np.ndarray]], list[np.ndarray]]  # feeds by the cut's input names -> y, presents


def _run_block(run: Run, block: Any, x: np.ndarray, past_len: int, past: tuple[np.ndarray, np.ndarray],
               lengths: np.ndarray | None = None) -> list[np.ndarray]:  # fmt: skip
    """One call of the cut block; lengths: each row's tokens of a right-padded prompt (seqlens_k + 1)."""
    batch, tokens, _ = x.shape
    total = past_len + tokens
    seqlens = np.full((batch,), total, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    return run({block.inputs["x"]: x.astype(np.float32), block.inputs["seqlens_k"]: seqlens - 1,
                block.inputs["total_sequence_length"]: np.array(total, np.int32),
                block.inputs["past_key"]: past[0], block.inputs["past_value"]: past[1]})  # fmt: skip


BACKENDS = ("ort-cpu", "openvino", "ort-cuda")


def _runner(backend: str, cut: bytes) -> Run | str:
    """The cut block loaded on `backend` (a Run), or why the backend is unavailable on this machine (a str: a
    skip). A backend that is here but cannot read or compile the block raises: a finding."""
    if backend == "openvino":
        reason = openvino_unavailable_reason()
        if reason is not None:
            return reason
        import openvino as ov

        with tempfile.TemporaryDirectory(prefix="attnx-audit-") as folder:  # OpenVINO reads ONNX from a file
            path = os.path.join(folder, "block.onnx")
            with open(path, "wb") as f:
                f.write(cut)
            core = ov.Core()
            compiled = core.compile_model(core.read_model(path), DEVICE, compile_config("fp32", runtime_threads()))
        return lambda feeds: [np.asarray(v) for v in compiled(feeds).values()]
    import onnxruntime as ort

    provider = PROVIDERS["cuda" if backend == "ort-cuda" else "cpu"].ort_name
    if backend == "ort-cuda" and (reason := ort_cuda_unavailable_reason()) is not None:
        return reason
    options = ort.SessionOptions()
    options.log_severity_level = 4  # ORT's own error lines: the audit reports the error it raises
    if (threads := runtime_threads()) is not None:  # ATTNX_THREADS, as every attnx session
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(cut, options, providers=[provider])
    if session.get_providers()[0] != provider:  # never a CUDA run that fell back to the CPU
        raise RuntimeError(f"onnxruntime did not start {provider} (session providers: {session.get_providers()})")
    return lambda feeds: session.run(None, feeds)


def audit_model(
    model_path: str,
    *,
    checkpoint: str | None = None,
    layers: Sequence[int] | None = None,
    backends: Sequence[str] = ("ort-cpu",),
    progress: Callable[[str], None] | None = None,
) -> AuditReport:
    """Audit every attention block of `model_path` (see the module's docstring)."""
    import onnx_ir as ir

    say = progress or (lambda _m: None)
    for name in backends:
        if name not in BACKENDS:
            raise UsageError(f"backend {name!r}: the audit runs on {', '.join(BACKENDS)}")
    check_external_data(model_path)
    import onnx
    from onnx.utils import Extractor

    model = ir.load(model_path)  # external data read tensor by tensor, as a block reaches it
    # the structure the blocks are cut from, without its data, typed once (Extractor runs shape inference)
    extractor = Extractor(onnx.load(model_path, load_external_data=False))
    base_dir = os.path.dirname(os.path.abspath(model_path))
    source = CheckpointLayers(checkpoint) if checkpoint is not None else None
    report = AuditReport(model_path, checkpoint, [], [])
    seen = 0
    asked = set(layers) if layers is not None else None
    for block in iter_blocks(model, report.unread, None if asked is None else asked.__contains__):
        seen += 1
        if layers is not None and block.index not in layers:
            continue
        say(f"block {block.index}: {block.node}")
        report.blocks.append(_audit_block(extractor, base_dir, block, source, backends, report.skipped))
        block.weights = None  # one block's weights at a time
    if not seen and not report.unread:
        raise UsageError(f"{model_path}: no attention block found")
    missing = sorted(set(layers or ()) - {b.index for b in report.blocks})
    if missing:
        raise UsageError(f"--layers {','.join(map(str, missing))}: the model has {seen} block(s) read"
                         + (f" (0 to {seen - 1})" if seen else ""))  # fmt: skip
    return report


def _audit_block(extractor: Any, base_dir: str, block: Any, source: CheckpointLayers | None,
                 backends: Sequence[str], skipped: list[str]) -> BlockAudit:  # fmt: skip
    findings, not_checked, checks = [], [], []
    layer = None
    config, weights = block.config, block.weights
    imported = source is not None
    if source is not None:
        layer = source.pair(block.weights["q_proj.weight"])
        if layer is None:
            findings.append(f"block {block.index}: no checkpoint layer has its q projection's shape")
        else:
            paired = source.layer(layer)  # this block's layer alone, dropped with the block's audit
            findings += _compare_terms(block, paired.config, paired.weights, layer)
            config, weights = paired.config, paired.weights  # the reference is the checkpoint's layer
    if config is not None:
        config = dataclasses.replace(config, kv_cache=False, key_padding_mask=False)
    terms = tuple(t for t in (config.terms if config is not None else ()) if t != "causal")
    audit = BlockAudit(block.index, block.node, block.core, layer, terms, findings, checks, not_checked)
    if block.unread and not imported:
        not_checked.append(f"block {block.index}: {block.unread}")
        return audit
    level = block.quantization["accuracy_level"] if block.quantization is not None else None
    if level not in (None, 0, 1, 4):
        not_checked.append(f"block {block.index}: MatMulNBits accuracy_level {level} (fp16/bf16 compute): its error "
                           "model is not built yet (levels 0, 1 and 4 are checked)")  # fmt: skip
        return audit
    if block.quantization is not None and imported:
        # the file's own dequantized weights: the quantization is what the int4 form is, not a finding
        weights = {**weights, **{k: v for k, v in block.weights.items() if k.endswith("_proj.weight")}}
    shape = AUDIT_SHAPE
    rng = np.random.Generator(np.random.PCG64(block.index))
    x = rng.standard_normal((shape["batch"], shape["tokens"], config.d_model), dtype=np.float32)
    positions = np.broadcast_to(np.arange(shape["tokens"], dtype=np.int64), x.shape[:2])
    feeds = {"x": x, "position_ids": positions} if config.rope is not None else {"x": x}
    block_size = block.quantization["block_size"] if level == 4 else None

    def reference(**call: np.ndarray) -> np.ndarray:
        return _reference(config, weights, call, block_size)

    ref = reference(**feeds)
    size = problem_size(config, weights, feeds)
    cut = _cut(extractor, block, base_dir)
    for backend in backends:
        try:
            run = _runner(backend, cut)
        except Exception as e:  # noqa: BLE001 - each runtime's own error types: a backend asked for cannot read it
            findings.append(f"block {block.index}: {backend} cannot load {block.node}: {_first_line(e)}")
            continue
        if isinstance(run, str):  # unavailable on this machine: a skip, as in parity
            if f"{backend}: {run}" not in skipped:
                skipped.append(f"{backend}: {run}")
            continue
        _run_checks(run, backend, block, feeds, ref, reference, size, audit)
    return audit


def _run_checks(run: Run, backend: str, block: Any, feeds: dict[str, np.ndarray], ref: np.ndarray,
                reference: Callable[..., np.ndarray], size: Any, audit: BlockAudit) -> None:  # fmt: skip
    """The block on one backend: a full sequence, a right-padded batch, a prefill and steps through its cache."""
    shape, x = AUDIT_SHAPE, feeds["x"]
    batch, tokens = x.shape[:2]
    capacity = block.config.sliding_window if block.facts.get("sliding_window_cache") else 0
    empty = np.zeros((batch, block.config.n_kv_heads, capacity, block.config.head_dim), np.float32)
    tol = tolerance_for("fp32")
    label = f"{backend}: " if backend != "ort-cpu" else ""
    outputs: list[tuple[np.ndarray, np.ndarray]] = []  # (what the block gave, its reference), per check
    checks = []
    try:
        y, *_ = _run_block(run, block, x, 0, (empty, empty))
        outputs.append((y, ref))
        checks.append(compare_arrays(f"{label}full sequence ({tokens} tokens)", y, ref, tol, size))
        # a padded batch in GroupQueryAttention's own convention: right padding, each row's length in seqlens_k
        # (its schema: "must be a right padding mask"), every row against the reference of its own tokens
        short = tokens - shape["padding"]
        try:
            y, *_ = _run_block(run, block, x, 0, (empty, empty), lengths=np.array([tokens, short]))
        except Exception as e:  # the runtime's own error types (re-raised but for the ring buffer)
            if not block.facts.get("sliding_window_cache"):
                raise
            # ORT 1.31 refuses a row shorter than the prompt when the window is kept in a ring buffer
            audit.not_checked.append(f"block {block.index}: {label}a padded batch (rows of {tokens} and {short} "
                                     f"tokens), which {backend} refuses with a sliding_window_cache: {_first_line(e)}")  # fmt: skip
        else:
            row = {k: v[1:, :short] for k, v in feeds.items()}
            padded_ref = np.concatenate([ref[0:1], reference(**row)], axis=1)
            outputs.append((np.concatenate([y[0:1], y[1:, :short]], axis=1), padded_ref))
            checks.append(compare_arrays(f"{label}padded batch (rows of {tokens} and {short} tokens)", *outputs[-1],
                                         tol, size))  # fmt: skip
        # the model's own cache: what the block returns as present is the next step's past (a window kept in
        # a ring buffer, sliding_window_cache, returns its buffer of the window's capacity)
        prefill = shape["prefill"]
        y, pk, pv = _run_block(run, block, x[:, :prefill], 0, (empty, empty))
        steps = [y]
        for t in range(prefill, tokens):
            y, pk, pv = _run_block(run, block, x[:, t : t + 1], t, (pk, pv))
            steps.append(y)
        outputs.append((np.concatenate(steps, axis=1), ref))
        checks.append(compare_arrays(f"{label}prefill {prefill} + {tokens - prefill} steps", *outputs[-1], tol, size))
    except Exception as e:  # noqa: BLE001 - the runtime's own error types, on the model as exported
        audit.findings.append(f"block {block.index}: {label}{block.node} fails to run: {_first_line(e)}")
    audit.checks.extend(checks)
    for c, (out, expected) in zip(checks, outputs):
        if c.shape_error is not None:  # an output of another shape (OpenVINO's empty one, on one thread)
            audit.findings.append(f"block {block.index}: {c.name}: {c.shape_error}")
        elif not c:
            audit.findings.append(f"block {block.index}: {c.name} against the reference fails: max_abs "
                                  f"{c.max_abs:.3g} > atol {c.atol:.3g}, first at position "
                                  f"{_first_position(out, expected, c)}")  # fmt: skip


def int8_blocks(a: np.ndarray, block: int) -> np.ndarray:
    """`a` as MatMulNBits at accuracy_level 4 computes with it: each row's blocks of `block` values along the last
    axis quantized to int8, symmetric, scale = max |a| / 127, rounded to nearest even, and back (float64)."""
    a = np.asarray(a, np.float32)
    rows = _blocks_of(a, block)
    amax = np.abs(rows).max(axis=2, keepdims=True)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    q = np.clip(np.rint(rows * inverse), -127, 127)
    back = (q * (amax / np.float32(127))).reshape(rows.shape[0], -1)[:, : a.shape[-1]]
    return back.reshape(a.shape).astype(np.float64)


def _blocks_of(a: np.ndarray, n: int) -> np.ndarray:
    """a [..., k] as [rows, ceil(k / n), n], zero-padded along k: the blocks MatMulNBits quantizes along its input."""
    k = a.shape[-1]
    return np.pad(a.reshape(-1, k), ((0, 0), (0, (-k) % n))).reshape(-1, -(-k // n), n)


def _reference(config: AttentionConfig, weights: dict[str, np.ndarray], feeds: dict[str, np.ndarray],
               block_size: int | None) -> np.ndarray:  # fmt: skip
    """The float64 reference; with block_size, of the model as MatMulNBits computes at accuracy_level 4: the
    projections' inputs (x, and the heads' output z before out_proj) in int8 blocks (int8_blocks)."""
    if block_size is None:
        return np.asarray(reference_attention(config, weights, **feeds))
    stages: dict[str, np.ndarray] = {}
    reference_attention(config, weights, **{**feeds, "x": int8_blocks(feeds["x"], block_size)}, stages=stages,
                        core_stages=False)  # fmt: skip
    z = int8_blocks(stages["z"].astype(np.float32), block_size)
    bias = weights.get("out_proj.bias")  # a config without biases has none
    return z @ np.asarray(weights["out_proj.weight"], np.float64).T + (0.0 if bias is None else np.asarray(bias, np.float64))


def _first_line(e: BaseException) -> str:
    """A runtime's message in one line: ONNX Runtime's without its "[ONNXRuntimeError] : 2 : ... : " prefix;
    OpenVINO's informative line (its first lines are source locations)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].startswith("Exception from src/"):
        return next((line for line in lines if "not supported" in line), lines[-1])[:300]
    return lines[0].rsplit(" : ", 1)[-1][:300]


def _first_position(out: np.ndarray, ref: np.ndarray, c: Comparison) -> int:
    """The first token position where some output is outside the comparison's bound."""
    bad = np.abs(np.asarray(out, np.float64) - ref) > c.atol + c.rtol * np.abs(ref)
    return int(np.argmax(bad.any(axis=(0, 2))))
