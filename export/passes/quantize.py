"""QuantizeProjections: an onnx-ir pass that quantizes the four projections of an attnx graph.

Every MatMul whose second operand is a constant 2-D weight [K, N] is a projection (q, k, v,
out, or the packed q/k/v of ort-fused-packed); the attention core's MatMuls multiply two
activations and are left alone, as are the inputs, the output and the core (float32). Each
projection becomes one ONNX Runtime contrib node (com.microsoft, with its opset import):

- int8: DynamicQuantizeMatMul(x / r, W_q int8 [K, N], scale [N], zero_point int8 [N]) * r: weights
  symmetric per output channel in 7 or 8 bits (scale_n = max_k |W_kn| / 63 or / 127, INT8_WEIGHT_MAX;
  7 bits: no int16 overflow in the u8s8 kernel of a CPU without VNNI, attnx.model.int8), zero point 0
  (stored so a runtime reads it), the width in the metadata (INT8_BITS_KEY); the input quantized at
  run time to uint8 per row (token): r = max(max_k |x_k|, FLT_MIN)
  of each row (ReduceMax over the last axis, shared by the projections that read the same input),
  so every row of x / r spans [-1, 1] and the op's per-tensor quantization gives each row a step of
  2 r / 255; the product is scaled back by r (MLAS's u8s8 GEMM, VNNI).
- int4: MatMulNBits(x, B uint8 [N, K/block, block/2], scales [N*K/block], zero_points packed),
  bits 4, weight-only: asymmetric per block of `block_size` along K (a zero point per block, two
  4-bit values a byte, the low nibble first), `accuracy_level` 4 quantizes the input to int8
  per block and multiplies in int8 (0 or 1: float32).

Why these (measurements/quantized_forms: the candidates timed and their error, one run each):
DynamicQuantizeMatMul is the fastest int8 form at seq 512 and 4096, so `int8` is it. Its input per row
rather than per tensor: one scale for a whole [batch, seq, K] tensor is set by its largest value, and
the input's rounding is most of int8's error; dividing each row by its max |x| first costs three
elementwise passes over x and y for a fifth less error. Static QDQ quantizes with a calibrated range,
so it keeps no per-row scale and its outputs are requantized: more error, no speed. MatMulNBits is
what `int4` needs (the only 4-bit kernel); block 32 is the default for its accuracy (128 is a little
faster for more error), accuracy_level 4 since it is faster.

Why a pass of our own and not onnxruntime.quantization.quantize_dynamic: that tool writes
DynamicQuantizeLinear + MatMulInteger + Mul chains that only become DynamicQuantizeMatMul when
ONNX Runtime fuses them at load time, works on a ModelProto (protobuf's 2 GB limit, the gpt3
preset is over it; the fp16 pass has the same reason), and would quantize whatever MatMul it
finds. What attnx needs is four node replacements with a recorded error model: the quantization
step of every weight (attnx.model.tolerance reads it from the metadata this pass writes).
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import onnx_ir as ir

from attnx.errors import UsageError
from attnx.export.passes._base import const_array, fresh_name
from attnx.model.contract import DTYPE_KEY, INT8_BITS_KEY, IO_DTYPE_KEY, MS_DOMAIN, QUANT_KEY, QUANTIZATIONS
from attnx.model.int8 import INT8_BITS, INT8_WEIGHT_MAX, int8_bits_text, int8_weight_bits

__all__ = [
    "BLOCK_SIZES",
    "DEFAULT_ACCURACY_LEVEL",
    "DEFAULT_BLOCK_SIZE",
    "QuantizeProjections",
    "dequantize_node",
    "quantize_int8",
    "quantize_nbits",
]

DEFAULT_BLOCK_SIZE = 32
DEFAULT_ACCURACY_LEVEL = 4
BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits' block sizes: powers of 2, at least 16
ACCURACY_LEVELS = (0, 1, 2, 3, 4)

_STD = ("", "ai.onnx")


def quantize_int8(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [K, N] float -> (q int8 [K, N] in [-m, m], scale float32 [N], zero_point int8 [N]), symmetric per
    output column: W ~ (q - zero_point) * scale, each weight within scale/2. bits 7 (m 63: the u8s8 kernel of
    a CPU without VNNI adds two u8 * s8 products in an int16 that 8 bits overflow) or 8 (m 127: a host with
    VNNI); INT8_WEIGHT_MAX, attnx.model.int8 (measurements/int8_range: the error of each on each CPU)."""
    if bits not in INT8_BITS:
        raise UsageError(f"int8 weights are 7 or 8 bits, not {bits!r}")
    qmax = INT8_WEIGHT_MAX[bits]
    scale = np.abs(w).max(axis=0).astype(np.float32) / np.float32(qmax)  # [N]
    scale[scale == 0] = 1.0  # an all-zero column: any scale represents it exactly
    q = np.clip(np.rint(w / scale), -qmax, qmax).astype(np.int8)
    return q, scale, np.zeros(w.shape[1], np.int8)


def quantize_nbits(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W [K, N] float -> MatMulNBits' (B uint8 [N, ceil(K/block), block*bits/8], scales float32
    [N*ceil(K/block)], zero_points uint8), asymmetric per block of K: W ~ (q - zp) * scale."""
    k, n = w.shape
    blocks = -(-k // block_size)  # the last block is padded with zero weights (exact in every block)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = w
    wb = np.ascontiguousarray(padded.T).reshape(n, blocks, block_size)  # (N, K/block, block)
    qmax = 2**bits - 1
    lo, hi = np.minimum(wb.min(-1), 0.0), np.maximum(wb.max(-1), 0.0)  # the range holds 0: zp is exact
    scale = ((hi - lo) / qmax).astype(np.float32)
    scale[scale == 0] = 1.0
    zp = np.clip(np.rint(-lo / scale), 0, qmax).astype(np.uint8)  # (N, K/block)
    q = np.clip(np.rint(wb / scale[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)  # two values a byte, the low nibble first
        zp_padded = np.zeros((n, blocks + blocks % 2), np.uint8)
        zp_padded[:, :blocks] = zp
        zp = zp_padded[:, 0::2] | (zp_padded[:, 1::2] << 4)  # (N, ceil(blocks/2))
    return q.astype(np.uint8), scale.reshape(-1), zp.reshape(-1).astype(np.uint8)


def _unpack_nbits(node: ir.Node) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    b, scales = const_array(node.inputs[1]), const_array(node.inputs[2])
    zps = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    if b is None or scales is None:
        return None
    bits = node.attributes.get_int("bits", 4)
    n, blocks = b.shape[0], b.shape[1]
    if bits == 4:
        q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, blocks, -1)
        zp = None if zps is None else np.stack([zps & 0x0F, zps >> 4], -1).reshape(n, -1)[:, :blocks]
    else:
        q, zp = b, None if zps is None else zps.reshape(n, blocks)
    if zp is None:
        zp = np.full((n, blocks), 2 ** (bits - 1))
    return q.astype(np.float32), scales.reshape(n, blocks).astype(np.float32), zp.astype(np.float32)


def dequantize_node(node: ir.Node) -> np.ndarray | None:
    """The float weight W [K, N] a quantized projection node computes with, or None when the
    node is not one (or its weights are not constants)."""
    if node.domain != MS_DOMAIN:
        return None
    if node.op_type == "DynamicQuantizeMatMul":
        q, scale = const_array(node.inputs[1]), const_array(node.inputs[2])
        zp = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        if q is None or scale is None:
            return None
        zero = np.zeros(q.shape[1]) if zp is None else zp.astype(np.float64)
        return ((q.astype(np.float64) - zero) * scale.astype(np.float64)).astype(np.float32)
    if node.op_type == "MatMulNBits":
        unpacked = _unpack_nbits(node)
        if unpacked is None:
            return None
        q, scale, zp = unpacked
        w = (q - zp[..., None]) * scale[..., None]  # (N, K/block, block)
        k = node.attributes.get_int("K", w.shape[1] * w.shape[2])
        return np.ascontiguousarray(w.reshape(w.shape[0], -1)[:, :k].T)
    return None


# The projections' weights as every graph attnx writes names them (docs/reference/onnx-graph.md, "Names"): <role>_proj.weight.T.
_PROJECTION_WEIGHT = {f"{role}_proj.weight.T": role for role in ("q", "k", "v", "qkv", "out")}


def projection_role(node: ir.Node) -> str | None:
    """The projection a MatMul is, read from its weight's name (q, k, v, qkv or out): the name the code
    that wrote the graph gave it (attnx.export._graph.linear; NameStages for the torch export), or None."""
    if node.op_type != "MatMul" or node.domain not in _STD or len(node.inputs) < 2 or node.inputs[1] is None:
        return None
    return _PROJECTION_WEIGHT.get(node.inputs[1].name or "")


def _stage_of(node: ir.Node, role: str) -> str:
    """The stage a projection leads to, as its output's name says (docs/reference/onnx-graph.md, "Names": q/matmul, or q
    itself without a bias), for the names of the nodes and values the quantization adds."""
    name = node.outputs[0].name
    return name.split("/")[0] if name else ("y" if role == "out" else role)


class QuantizeProjections(ir.passes.InPlacePass):
    """Replace every projection MatMul (constant 2-D weight) by its quantized contrib node and
    record the quantization in the model's metadata (the contract's QUANT_KEY, DTYPE_KEY)."""

    def __init__(self, dtype: str, block_size: int = DEFAULT_BLOCK_SIZE, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                 int8_bits: int | str = "auto") -> None:  # fmt: skip
        super().__init__()
        if dtype not in QUANTIZATIONS:
            raise UsageError(f"no quantized form {dtype!r} (known: {', '.join(QUANTIZATIONS)})")
        # int8's weight width: 7 or 8, auto this host's (attnx.model.int8); None for int4
        self.int8_bits = int8_weight_bits(dtype, int8_bits)
        self.int8_asked = int8_bits
        if block_size not in BLOCK_SIZES:
            raise UsageError(f"--block-size {block_size!r} must be one of {', '.join(map(str, BLOCK_SIZES))}")
        if accuracy_level not in ACCURACY_LEVELS:
            raise UsageError(f"--accuracy-level {accuracy_level!r} must be one of 0 to 4")
        self.dtype = dtype
        self.block_size = block_size
        self.accuracy_level = accuracy_level
        self.notes: list[str] = []

    def requires(self, model: ir.Model) -> None:
        if model.metadata_props.get(QUANT_KEY) is not None:
            raise ir.passes.PreconditionError("the model is quantized already")
        if model.metadata_props.get(DTYPE_KEY, "fp32") != "fp32":
            raise ir.passes.PreconditionError("only a float32 model can be quantized")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.notes = []
        self._rows: dict[int, tuple[ir.Value, ir.Value]] = {}  # int8: an input's (x / r, r)
        self._taken = {v.name for n in model.graph for v in n.outputs} | set(model.graph.initializers)
        self._node_names = {n.name for n in model.graph}
        if any(n.op_type == "Attention" and n.domain == MS_DOMAIN for n in model.graph):
            # its q/k/v weights are an input of the fused op itself: no projection MatMul is left
            raise UsageError("com.microsoft.Attention (ort-attention) holds its q/k/v weights: quantize "
                             "ort-fused, ort-fused-packed or decomposed")  # fmt: skip
        projections: dict[str, dict[str, Any]] = {}
        for node in list(model.graph):
            role = projection_role(node)  # by its weight's name: the core's products of activations have none
            w = const_array(node.inputs[1]) if role is not None else None
            if w is None or w.ndim != 2:
                continue
            projections[role] = self._replace(model, node, np.asarray(w, np.float32), role)
        if not projections:
            self.notes.append("not quantized: no projection MatMul with a constant weight in the graph")
            return ir.passes.PassResult(model, False)
        if MS_DOMAIN not in model.opset_imports:
            model.opset_imports[MS_DOMAIN] = 1
        q = QUANTIZATIONS[self.dtype]
        weights = q.weights if self.int8_bits is None else f"symmetric {self.int8_bits}-bit per output channel (int8 storage)"
        record: dict[str, Any] = {
            "dtype": self.dtype,
            "op": q.op,
            "bits": q.bits,
            "weights": weights,
            "per_channel": self.dtype == "int8",
            "block_size": self.block_size if self.dtype == "int4" else None,
            "accuracy_level": self.accuracy_level if self.dtype == "int4" else None,
            "activations": q.activations if self.dtype == "int8" or self.accuracy_level == 4 else "none",
            "projections": projections,
        }
        model.metadata_props[QUANT_KEY] = json.dumps(record, sort_keys=True)
        if self.int8_bits is not None:
            model.metadata_props[INT8_BITS_KEY] = str(self.int8_bits)
            self.notes.append(f"int8: {int8_bits_text(self.int8_bits, self.int8_asked)}")
        model.metadata_props[DTYPE_KEY] = self.dtype
        model.metadata_props[IO_DTYPE_KEY] = "fp32"
        return ir.passes.PassResult(model, True)

    def _fresh(self, name: str, node: bool = False) -> str:
        """`name` (of a value, or of a node), or with a counter when the graph has it (docs/reference/onnx-graph.md, "Names":
        unique)."""
        return fresh_name(name, self._node_names if node else self._taken)

    def _row_scaled(self, model: ir.Model, node: ir.Node, x: ir.Value, role: str) -> tuple[ir.Value, ir.Value]:
        """(x / r, r) with r = max(max |x| over the last axis, FLT_MIN) [..., 1]: made once per input
        (q, k and v read the same x), before the first projection that reads it, named after the
        stage that projection leads to (docs/reference/onnx-graph.md, "Names": q/row_max, y/row_max for z's)."""
        key = id(x)
        if key not in self._rows:
            stage = _stage_of(node, role)
            consts = {}
            for label, array in (("axes", np.array([-1], np.int64)),
                                 ("floor", np.array(np.finfo(np.float32).tiny, np.float32))):  # fmt: skip
                t = ir.tensor(array, name=self._fresh(f"{stage}/row_{label}"))
                consts[label] = ir.Value(name=t.name, shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype), const_value=t)
                model.graph.register_initializer(consts[label])
            absolute = ir.node("Abs", [x], name=self._fresh(f"{stage}/Abs", node=True))
            peak = ir.node("ReduceMax", [absolute.outputs[0], consts["axes"]], attributes={"keepdims": 1},
                           name=self._fresh(f"{stage}/ReduceMax", node=True))  # fmt: skip
            scale = ir.node("Max", [peak.outputs[0], consts["floor"]], name=self._fresh(f"{stage}/Max", node=True))  # an all-zero row: 0 / tiny
            scaled = ir.node("Div", [x, scale.outputs[0]], name=self._fresh(f"{stage}/Div", node=True))
            for new, label in ((absolute, "row_abs"), (peak, "row_max"), (scale, "row_scale"), (scaled, "row_scaled")):
                new.outputs[0].name = self._fresh(f"{stage}/{label}")
                model.graph.insert_before(node, new)
            scaled.outputs[0].shape, scaled.outputs[0].type = x.shape, x.type
            self._rows[key] = (scaled.outputs[0], scale.outputs[0])
        return self._rows[key]

    def _replace(self, model: ir.Model, node: ir.Node, w: np.ndarray, role: str) -> dict[str, Any]:
        """Swap one MatMul for its quantized node; the error model's inputs of this projection."""
        k, n = w.shape
        # the weight's name without the transposition (q_proj.weight.T: q_proj.weight.quant, .scale, .zero_point)
        base = (node.inputs[1].name or f"{role}_proj.weight").removesuffix(".T")
        x = node.inputs[0]
        if self.dtype == "int8":
            x, row_scale = self._row_scaled(model, node, x, role)
            q, scale, zp = quantize_int8(w, self.int8_bits)
            step_sq = float(np.mean(scale.astype(np.float64) ** 2))  # every weight of column n has step scale_n
            tensors = [ir.tensor(q, name=f"{base}.quant"), ir.tensor(scale, name=f"{base}.scale"),
                       ir.tensor(zp, name=f"{base}.zero_point")]  # fmt: skip
            op, attrs = "DynamicQuantizeMatMul", {}
        else:
            q, scale, zp = quantize_nbits(w, 4, self.block_size)
            step_sq = float(np.mean(scale.astype(np.float64) ** 2))  # every block has block_size weights
            tensors = [ir.tensor(q, name=f"{base}.quant"), ir.tensor(scale, name=f"{base}.scale"),
                       ir.tensor(zp, name=f"{base}.zero_point")]  # fmt: skip
            op = "MatMulNBits"
            attrs = {"K": k, "N": n, "bits": 4, "block_size": self.block_size, "accuracy_level": self.accuracy_level}
        values = []
        for t in tensors:
            value = ir.Value(name=t.name, shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype), const_value=t)
            model.graph.register_initializer(value)
            values.append(value)
        new = ir.node(op, [x, *values], attributes=attrs, domain=MS_DOMAIN, name=self._fresh(f"{role}_proj/{op}", node=True))
        old_out = node.outputs[0]
        new.outputs[0].shape, new.outputs[0].type = old_out.shape, old_out.type
        new.outputs[0].name = self._fresh(f"{_stage_of(node, role)}/{op.lower()}")  # int8: rescaled into old_out's name
        model.graph.insert_before(node, new)
        result = new.outputs[0]
        if self.dtype == "int8":  # back to x's scale, row by row
            rescale = ir.node("Mul", [result, row_scale], name=self._fresh(f"{role}_proj/Mul", node=True))
            rescale.outputs[0].shape, rescale.outputs[0].type = old_out.shape, old_out.type
            model.graph.insert_before(node, rescale)
            result = rescale.outputs[0]
        if old_out.is_graph_output():  # y itself when the output projection has no bias
            model.graph.outputs[model.graph.outputs.index(old_out)] = result
        ir.convenience.replace_all_uses_with(old_out, result)
        weight, name = node.inputs[1], old_out.name
        model.graph.remove(node, safe=True)
        result.name = name  # once the old value is gone: names stay unique
        if weight is not None and not weight.uses() and weight.name in model.graph.initializers:
            del model.graph.initializers[weight.name]
        w_rms = float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))
        step_rms = math.sqrt(step_sq)
        self.notes.append(f"{role} projection [{k}, {n}] -> {MS_DOMAIN}.{op} (step rms {step_rms:.3g})")
        # The error model's inputs (attnx.model.tolerance): rounding to the nearest step leaves an
        # error uniform in +-step/2, RMS step/sqrt(12), so the weight's relative RMS error is this.
        return {"k": k, "n": n, "step_rms": step_rms, "weight_rms": w_rms,
                "rel_error": step_rms / math.sqrt(12.0) / w_rms if w_rms > 0 else 0.0}  # fmt: skip
