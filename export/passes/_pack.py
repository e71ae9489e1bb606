"""Passes that pack the q, k, v projections of a fused self-attention (auto tries them).

Both start from the MultiHeadAttention node FuseAttentionToMHA writes, and apply only to
self-attention, where q, k and v are three MatMuls of the same input with constant weights:

- PackQkvProjections: one MatMul with the weights concatenated [D, Dq+Dk+Dv], then a Split,
  so the CPU runs one large GEMM instead of three (the fused op itself is unchanged).
- FuseMHAToPackedAttention: com.microsoft Attention, which takes x and the packed weights
  and does the projection inside the op (ORT's older, BERT-style kernel). The causal mask,
  the key padding mask, the scale and the bias carry over.

onnxscript's own MHA -> Attention rule (ort_fusions.attention) is not reused: it matches an
MHA node with `unidirectional=1` too and does not carry that attribute over, which would
silently drop a causal mask.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from attnx.export.passes._base import AttnxPass
from attnx.export.passes._masks import const_array
from attnx.model.contract import MS_DOMAIN

__all__ = ["PackQkvProjections", "FuseMHAToPackedAttention"]

logger = logging.getLogger(__name__)


class _SelfAttentionMHA(pattern.RewriteRuleClassBase):
    """MultiHeadAttention(MatMul(x, Wq), MatMul(x, Wk), MatMul(x, Wv), ...) with constant W."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.failures: list[str] = []
        self.count = 0

    def pattern(self, op, x, wq, wk, wv):
        return op.MultiHeadAttention(
            op.MatMul(x, wq), op.MatMul(x, wk), op.MatMul(x, wv),
            _domain=MS_DOMAIN, _allow_other_inputs=True, _outputs=["mha"],
        )  # fmt: skip

    def _fail(self, reason: str) -> pattern.MatchResult:
        if reason not in self.failures:
            self.failures.append(reason)
        return pattern.MatchResult().fail(reason)

    def check(self, context, x, wq, wk, wv, mha, **_) -> pattern.MatchResult:
        self.weights = [const_array(w) for w in (wq, wk, wv)]
        if any(w is None or w.ndim != 2 for w in self.weights):
            return self._fail("the q/k/v projection weights are not constant matrices")
        if len({w.shape[0] for w in self.weights}) != 1 or len({w.dtype for w in self.weights}) != 1:
            return self._fail("the q/k/v projection weights differ in input width or dtype")
        node = mha.producer()
        if any(v is not None for v in node.inputs[5:]) or any(o.uses() for o in node.outputs[1:]):
            return self._fail("the MultiHeadAttention node has an attention bias or a kv cache")
        return pattern.MatchResult()

    def rule_for_instance(self) -> pattern.RewriteRule:
        return pattern.RewriteRule(self.pattern, self.rewrite, self.check, name=self.name)

    def _packed_weight(self, op, wq: ir.Value) -> ir.Value:
        packed = np.concatenate(self.weights, axis=1)  # [D, Dq + Dk + Dv]
        return op.initializer(ir.tensor(packed, name=f"{wq.name}.qkv_packed"))


class _PackRule(_SelfAttentionMHA):
    def rewrite(self, op, x, wq, mha, **_):
        node = mha.producer()
        qkv = op.MatMul(x, self._packed_weight(op, wq))  # [B, S, Dq + Dk + Dv]
        sizes = op.Constant(value_ints=[w.shape[1] for w in self.weights])
        q, k, v = op.Split(qkv, sizes, axis=-1, _outputs=3)  # three [B, S, D*]
        self.count += 1
        return op.MultiHeadAttention(
            q, k, v, *node.inputs[3:5], _domain=MS_DOMAIN, **{a.name: a for a in node.attributes.values()}
        )


class _AttentionRule(_SelfAttentionMHA):
    def rewrite(self, op, x, wq, mha, **_):
        node = mha.producer()
        bias = node.inputs[3] if len(node.inputs) > 3 else None
        keep = node.inputs[4] if len(node.inputs) > 4 else None
        if bias is None:  # Attention's bias is required in the ORT versions attnx supports
            width = sum(w.shape[1] for w in self.weights)
            bias = op.initializer(ir.tensor(np.zeros(width, self.weights[0].dtype), name=f"{wq.name}.qkv_bias"))
        attrs = {a.name: a for a in node.attributes.values()}
        attrs["qkv_hidden_sizes"] = ir.AttrInt64s("qkv_hidden_sizes", [w.shape[1] for w in self.weights])
        self.count += 1
        inputs = [x, self._packed_weight(op, wq), bias] + ([keep] if keep is not None else [])
        # mask_index as a [B, L] int32 "1 keeps" mask: the same convention as MHA's key padding mask.
        return op.Attention(*inputs, _domain=MS_DOMAIN, **attrs)


class _RulePass(AttnxPass):
    rule_class: type[_SelfAttentionMHA] = _SelfAttentionMHA
    done = ""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        rule = self.rule_class(self.name)
        pattern.RewriteRuleSet([rule.rule_for_instance()]).apply_to_model(model)
        if rule.count:
            self.notes.append(f"{self.done} ({rule.count} node{'s' if rule.count > 1 else ''})")
        else:
            mhas = [n for n in model.graph if n.op_type == "MultiHeadAttention" and n.domain == MS_DOMAIN]
            reason = "; ".join(rule.failures) or (
                "q, k and v are not projections of one input (cross-attention)" if mhas
                else "no com.microsoft.MultiHeadAttention node to start from"
            )  # fmt: skip
            self.notes.append(f"not applied: {reason}")
        return ir.passes.PassResult(model, modified=rule.count > 0)


class PackQkvProjections(_RulePass):
    """Self-attention: the three q/k/v MatMuls become one MatMul and a Split."""

    rule_class = _PackRule
    done = "packed the q/k/v projections into one MatMul + Split"


class FuseMHAToPackedAttention(_RulePass):
    """Self-attention: MultiHeadAttention and its projections become com.microsoft Attention."""

    rule_class = _AttentionRule
    done = f"replaced MultiHeadAttention and its q/k/v MatMuls with {MS_DOMAIN}.Attention"
