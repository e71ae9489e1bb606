"""FuseAttentionToMHA: the attention core of an exported graph -> com.microsoft MultiHeadAttention.

Two rewrite rules, written with the onnxscript rewriter's pattern API, match the core in the
two forms the exporter writes (see model/module.py):

    decomposed:  Reshape/Transpose q, k, v to heads -> MatMul -> Mul(scale) -> [Where(hidden, lowest, .)]
                 -> Softmax -> MatMul -> [Where(any_visible, ., 0)] -> Transpose/Reshape back
    onnx:        the same with the opset-23 Attention op in the middle (is_causal, bool attn_mask)

and replace everything between the projections (q, k, v as [B, S, N*h]) and the output
projection with one MultiHeadAttention node, which takes the projections as they are (its
kernel splits the heads), the three projection biases as its `bias` input, the causal mask
as `unidirectional=1` and the key padding mask as int32 [B, L] (1 keeps: our bool mask
negated). The mask subgraphs are read by attnx.export.passes._masks and never guessed at.

The fused op does not zero a query whose keys are all hidden (it averages them), so the
rule keeps that guarantee of the formula (README, "The model") with a Where after the op, computed from
the key padding mask at [B, S] (never the [B, S, L] grid the export builds): "some key of
row b visible" for key padding alone, "some key j <= i visible" (a cumulative sum) with the
causal mask too. A causal mask alone hides no row entirely (query i sees key i).

onnxscript's own ort_fusions rules (fuse_sdpa, fuse_mha1/2, fuse_mha_bias) are not used for
this: they take additive masks only (ours are boolean), and on a cross-attention graph with
v_head_dim != head_dim fuse_sdpa matches but fuse_mha2 does not, which leaves an SDPA node
of their private fusion domain in the graph. One rule set that either replaces the whole
core or nothing keeps every output model runnable.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from attnx.export.passes._base import AttnxPass
from attnx.export.passes._masks import (
    KeyMask,
    NotFusable,
    classify_any_visible,
    classify_attend,
    classify_hidden,
    const_array,
)
from attnx.model.contract import MS_DOMAIN

__all__ = ["FuseAttentionToMHA", "FusionPlan", "attention_cores"]

logger = logging.getLogger(__name__)

# A masked score must lose every softmax: the exporter writes the dtype's lowest value; a
# fill above the lowest float16 value could leave a hidden key some weight.
_MAX_FILL = float(np.finfo(np.float16).min)
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


@dataclasses.dataclass
class FusionPlan:
    """What check() learnt about one match, for rewrite() and the report."""

    form: str  # "decomposed" or "onnx"
    n_heads: int
    head_dim: int
    v_head_dim: int
    scale: float
    mask: KeyMask
    zero_hidden_rows: bool  # the graph zeroes fully hidden queries (kept after fusion)

    def describe(self) -> str:
        return (
            f"{self.form} attention core ({self.mask.describe()}, {self.n_heads} heads, "
            f"head_dim {self.head_dim}, v_head_dim {self.v_head_dim}, scale {self.scale:.6g})"
        )


def _static(dim: object) -> int | None:
    return dim if isinstance(dim, int) else None


class _MHAFusionBase(pattern.RewriteRuleClassBase):
    """Shared check and rewrite of both forms; subclasses give the pattern and the mask."""

    form = ""

    def __init__(self, dtype: str = "fp32") -> None:
        super().__init__(f"FuseAttentionToMHA[{self.form}]")
        self.dtype = dtype
        self.plan: FusionPlan | None = None
        self.failures: list[str] = []
        self.fused: list[FusionPlan] = []

    def setup(self) -> None:
        self.plan = None

    def rule_for_instance(self) -> pattern.RewriteRule:
        """A RewriteRule bound to this instance (RewriteRuleClassBase.rule() makes its own
        instance, whose plans and failures the pass could not read)."""
        return pattern.RewriteRule(
            self.pattern,
            self.rewrite,
            self.check,
            name=self.name,
            remove_nodes=self.remove_nodes,
            graph_pre_visitor=self.setup,
            graph_post_visitor=self.cleanup,
            as_function=self.as_function,
        )

    # The parts both forms share -------------------------------------------------------
    def _heads(self, op, x3, shape, name: str):
        """[B, S, N*h] -> [B, S, N, h] -> [B, N, S, h], with the reshaped value named."""
        return op.Transpose(op.Reshape(x3, shape, _outputs=[name]), perm=[0, 2, 1, 3])

    def _tail(self, op, z, visible, zero, out_shape):
        """[B, N, S, vh] -> optional zeroing of hidden rows -> [B, S, N*vh]."""
        z = pattern.OrValue([op.Where(visible, z, zero), z], tag_var="zeroed", tag_values=[True, False])
        return op.Reshape(op.Transpose(z, perm=[0, 2, 1, 3]), out_shape, _outputs=["out"])

    def _fail(self, reason: str) -> pattern.MatchResult:
        if reason not in self.failures:
            self.failures.append(reason)
        logger.debug("%s: not fused: %s", self.name, reason)
        return pattern.MatchResult().fail(reason)

    def _check_shapes(self, q3, k3, v3, q_heads, k_heads, v_heads, out) -> tuple[int, int, int, object, object]:
        """(N, head_dim, v_head_dim, S, L) from the annotated shapes, or NotFusable."""
        for v in (q3, k3, v3, q_heads, k_heads, v_heads, out):
            if v.shape is None:
                raise NotFusable(f"the shape of {v.name!r} is unknown")
        if [v.shape.rank() for v in (q3, k3, v3, q_heads, k_heads, v_heads, out)] != [3, 3, 3, 4, 4, 4, 3]:
            raise NotFusable("the attention core's inputs are not [batch, seq, heads*dim] projections")
        batch, q_len, n, hd = q_heads.shape
        _, kv_len, kn, khd = k_heads.shape
        _, v_len, vn, vhd = v_heads.shape
        n, hd, vhd = _static(n), _static(hd), _static(vhd)
        if n is None or hd is None or vhd is None:
            raise NotFusable("the number of heads or the head size is not a fixed number")
        if kn != n or vn != n or khd != hd:
            raise NotFusable(f"q, k and v heads disagree: q [{n}, {hd}], k [{kn}, {khd}], v [{vn}, {vhd}]")
        # The Reshapes only split the last axis into heads when everything else is unchanged.
        for x3, heads, width in ((q3, q_heads, n * hd), (k3, k_heads, n * hd), (v3, v_heads, n * vhd)):
            if list(x3.shape)[:2] != list(heads.shape)[:2] or x3.shape[2] != width:
                raise NotFusable(f"{x3.name!r} {list(x3.shape)} is not split into heads by {list(heads.shape)}")
        if v_len != kv_len or k_heads.shape[0] != batch or v_heads.shape[0] != batch:
            raise NotFusable("k and v disagree on batch or length")
        if list(out.shape) != [batch, q_len, n * vhd]:
            raise NotFusable(f"the heads are not joined back into [batch, seq, {n * vhd}]")
        if q3.dtype not in _FLOATS or k3.dtype != q3.dtype or v3.dtype != q3.dtype:
            raise NotFusable(f"q, k, v are {q3.dtype}/{k3.dtype}/{v3.dtype}; MultiHeadAttention takes float or float16")
        return n, hd, vhd, q_len, kv_len

    def _check_zeroing(self, zeroed: bool, visible, zero, mask: KeyMask, q_len, kv_len) -> bool:
        """Whether fully hidden rows must be zeroed after the fused op."""
        if not zeroed:
            if mask.key_padding is not None:
                # The fused op would give such rows the mean of v instead of what the graph gives.
                raise NotFusable("a key padding mask without the zeroing of fully hidden rows")
            return False
        zero_value = const_array(zero)
        if zero_value is None or zero_value.size != 1 or float(zero_value.ravel()[0]) != 0.0:
            raise NotFusable("the Where after the attention core does not write zeros")
        if classify_any_visible(visible, q_len, kv_len) != mask:
            raise NotFusable("the zeroing condition and the attention mask disagree")
        return True

    def check(self, context, **bindings) -> pattern.MatchResult:
        self.plan = None
        try:
            self.plan = self._plan(**bindings)
        except NotFusable as e:
            return self._fail(str(e))
        return pattern.MatchResult()

    def _plan(self, **bindings) -> FusionPlan:
        raise NotImplementedError

    # Replacement ------------------------------------------------------------------------
    def rewrite(self, op, q3, k3, v3, out, **_):
        plan = self.plan
        assert plan is not None, "rewrite() without a successful check()"
        dtype = q3.dtype
        query, key, value, bias = _fold_biases(op, q3, k3, v3, dtype)
        keep = None
        if plan.mask.key_padding is not None:
            # Our mask: bool, True hides. MultiHeadAttention's: int32 [B, L], 1 keeps.
            keep = op.Cast(op.Not(plan.mask.key_padding), to=ir.DataType.INT32)
        lowest = float(np.finfo(np.float32 if self.dtype == "fp32" else np.float16).min)
        attrs = dict(num_heads=plan.n_heads, scale=plan.scale, mask_filter_value=lowest)
        if plan.mask.causal:
            attrs["unidirectional"] = 1
        inputs = [query, key, value, bias, keep]
        while inputs[-1] is None:  # trailing optional inputs are left out, not given as ""
            inputs.pop()
        z = op.MultiHeadAttention(*inputs, _domain=MS_DOMAIN, **attrs)  # [B, S, N*vh]
        _annotate(z, dtype, out.shape)
        self.fused.append(plan)
        if not plan.zero_hidden_rows or keep is None:
            return z  # nothing to zero: no mask, or a causal mask alone (query i sees key i)
        kpm_shape = plan.mask.key_padding.shape
        _annotate(keep, ir.DataType.INT32, kpm_shape)
        if plan.mask.causal:
            seen = op.CumSum(keep, op.Constant(value_int=1))  # [B, S]: visible keys j <= i
            seen_shape = kpm_shape
        else:
            seen = op.ReduceMax(keep, op.Constant(value_ints=[1]), keepdims=1)  # [B, 1]: visible keys
            seen_shape = ir.Shape([kpm_shape[0], 1])
        _annotate(seen, ir.DataType.INT32, seen_shape)
        visible = op.Unsqueeze(op.Cast(seen, to=ir.DataType.BOOL), op.Constant(value_ints=[2]))  # [B, S|1, 1]
        _annotate(visible, ir.DataType.BOOL, ir.Shape([*seen_shape, 1]))
        zero = op.Constant(value=ir.tensor(np.zeros((), dtype=dtype.numpy())))
        y = op.Where(visible, z, zero)
        _annotate(y, dtype, out.shape)
        return y


def _annotate(value: ir.Value, dtype: ir.DataType, shape: ir.Shape | None) -> None:
    """Type and shape of a new value, so later passes (fp16) and readers see them."""
    value.dtype = dtype
    if shape is not None:
        value.shape = ir.Shape(list(shape))


def _bias_of(x3: ir.Value) -> tuple[ir.Value, np.ndarray | None]:
    """(MatMul output, bias) when x3 = Add(MatMul(.), constant [width]), else (x3, None)."""
    node = x3.producer()
    if node is None or node.op_type != "Add" or node.domain not in ("", "ai.onnx"):
        return x3, None
    width = x3.shape[-1] if x3.shape is not None else None
    for i in (0, 1):
        b = const_array(node.inputs[1 - i])
        # Only a bias on the last axis is one the fused op can take; anything else stays an Add.
        if b is not None and b.ndim == 1 and b.shape[0] == width and node.inputs[i].shape == x3.shape:
            return node.inputs[i], b
    return x3, None


def _fold_biases(op, q3: ir.Value, k3: ir.Value, v3: ir.Value, dtype: ir.DataType):
    """q, k, v without their bias Adds and the op's packed bias [Dq + Dk + Dv], or the
    projections as they are (bias None) when none has a foldable bias."""
    parts = [_bias_of(x) for x in (q3, k3, v3)]
    if all(b is None for _, b in parts):
        return q3, k3, v3, None
    biases = [b if b is not None else np.zeros(x.shape[-1], dtype.numpy()) for (x, b) in parts]
    packed = np.concatenate([np.asarray(b, dtype=dtype.numpy()) for b in biases])
    bias = op.initializer(ir.tensor(packed, name=f"{q3.name}.mha_bias"))
    return parts[0][0], parts[1][0], parts[2][0], bias


class _DecomposedToMHA(_MHAFusionBase):
    form = "decomposed"

    def pattern(self, op, q3, k3, v3, q_shape, k_shape, v_shape, scale, hidden, fill, visible, zero, out_shape):
        q = self._heads(op, q3, q_shape, "q_heads")  # [B, N, S, h]
        k_heads = op.Reshape(k3, k_shape, _outputs=["k_heads"])  # [B, L, N, h]
        # k transposed to [B, N, h, L]: one Transpose as the exporter writes it, or two.
        k_t = pattern.OrValue(
            [
                op.Transpose(k_heads, perm=[0, 2, 3, 1]),
                op.Transpose(op.Transpose(k_heads, perm=[0, 2, 1, 3]), perm=[0, 1, 3, 2]),
            ]
        )
        v = self._heads(op, v3, v_shape, "v_heads")  # [B, N, L, vh]
        s = op.MatMul(q, k_t)  # [B, N, S, L]
        s = pattern.OrValue(
            [op.Mul(s, scale), op.Div(s, scale), s], tag_var="scaling", tag_values=["mul", "div", "none"]
        )
        s = pattern.OrValue([op.Where(hidden, fill, s), s], tag_var="masked", tag_values=[True, False])
        p = op.Softmax(s, _outputs=["probs"])
        z = op.MatMul(p, v)  # [B, N, S, vh]
        return self._tail(op, z, visible, zero, out_shape)

    def _plan(self, q3, k3, v3, q_heads, k_heads, v_heads, out, probs, scaling, masked, zeroed,
              scale=None, hidden=None, fill=None, visible=None, zero=None, **_) -> FusionPlan:  # fmt: skip
        n, hd, vhd, q_len, kv_len = self._check_shapes(q3, k3, v3, q_heads, k_heads, v_heads, out)
        axis = probs.producer().attributes.get_int("axis", -1)
        if axis not in (-1, 3):
            raise NotFusable(f"the softmax runs over axis {axis}, not over the keys")
        factor = 1.0
        if scaling != "none":
            s = const_array(scale)
            if s is None or s.size != 1:
                raise NotFusable("the scores are scaled by a value that is not a constant scalar")
            factor = float(s.ravel()[0]) if scaling == "mul" else 1.0 / float(s.ravel()[0])
        mask = KeyMask()
        if masked:
            f = const_array(fill)
            if f is None or f.size != 1 or not float(f.ravel()[0]) <= _MAX_FILL:
                raise NotFusable("hidden scores are not set to the lowest float (they would keep some weight)")
            mask = classify_hidden(hidden, q_len, kv_len)
        zeroing = self._check_zeroing(zeroed, visible, zero, mask, q_len, kv_len)
        return FusionPlan("decomposed", n, hd, vhd, factor, mask, zeroing)


class _OnnxAttentionToMHA(_MHAFusionBase):
    form = "onnx"

    def pattern(self, op, q3, k3, v3, q_shape, k_shape, v_shape, visible, zero, out_shape):
        q = self._heads(op, q3, q_shape, "q_heads")
        k = self._heads(op, k3, k_shape, "k_heads")
        v = self._heads(op, v3, v_shape, "v_heads")
        z = op.Attention(q, k, v, _allow_other_inputs=True, _outputs=["attention"])
        return self._tail(op, z, visible, zero, out_shape)

    def _plan(self, q3, k3, v3, q_heads, k_heads, v_heads, out, attention, zeroed,
              visible=None, zero=None, **_) -> FusionPlan:  # fmt: skip
        n, hd, vhd, q_len, kv_len = self._check_shapes(q3, k3, v3, q_heads, k_heads, v_heads, out)
        node = attention.producer()
        extra_inputs = [v for v in node.inputs[4:] if v is not None]
        if extra_inputs or any(o.uses() for o in node.outputs[1:]):
            raise NotFusable("the Attention op uses a kv cache or returns more than its output")
        if node.attributes.get_float("softcap", 0.0) != 0.0:
            raise NotFusable("the Attention op caps its scores (softcap)")
        if node.attributes.get_int("qk_matmul_output_mode", 0) != 0:
            raise NotFusable("the Attention op returns intermediate scores")
        scale = node.attributes.get_float("scale", None)
        scale = 1.0 / math.sqrt(hd) if scale is None else scale
        mask = KeyMask(causal=bool(node.attributes.get_int("is_causal", 0)))
        if mask.causal and not (q_len == kv_len and isinstance(q_len, (int, ir.SymbolicDim))):
            raise NotFusable("a causal Attention op whose query and key lengths may differ")
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            mask = mask | classify_attend(node.inputs[3], q_len, kv_len)
        zeroing = self._check_zeroing(zeroed, visible, zero, mask, q_len, kv_len)
        return FusionPlan("onnx", n, hd, vhd, scale, mask, zeroing)


def attention_cores(model: ir.Model) -> list[str]:
    """Names of the unfused attention cores left in the main graph (Softmax or opset-23
    Attention nodes): what the fusion pass should have replaced."""
    return [
        node.name or node.op_type
        for node in model.graph
        if node.domain in ("", "ai.onnx") and node.op_type in ("Softmax", "Attention")
    ]


class FuseAttentionToMHA(AttnxPass):
    """Replace each attention core with one com.microsoft MultiHeadAttention node.

    dtype is the compute dtype the model will have ("fp16" when an fp16 conversion follows),
    which sets the value the fused op gives hidden scores. A core the rules cannot replace
    stays as it is (still correct) and the notes say why.
    """

    def __init__(self, dtype: str = "fp32") -> None:
        super().__init__()
        self.dtype = dtype
        self.plans: list[FusionPlan] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.plans = []
        rules = [_DecomposedToMHA(self.dtype), _OnnxAttentionToMHA(self.dtype)]
        count = pattern.RewriteRuleSet([r.rule_for_instance() for r in rules]).apply_to_model(model)
        for rule in rules:
            for plan in rule.fused:
                self.plans.append(plan)
                self.notes.append(f"fused {plan.describe()} into {MS_DOMAIN}.MultiHeadAttention")
        left = attention_cores(model)
        if left:
            reasons = [f for r in rules for f in r.failures] or ["the attention core's pattern did not match"]
            for reason in reasons:
                self.notes.append(f"not fused ({', '.join(left)} kept, still correct): {reason}")
        if count and MS_DOMAIN not in model.opset_imports:
            model.opset_imports[MS_DOMAIN] = 1
        return ir.passes.PassResult(model, modified=count > 0)

