"""The modern-LLM terms (docs/concepts/formula.md, "Modern LLM attention") as pieces of the hand-built graphs, in
each core's own operators (attnx.model.cores.TermOps, a core's term_ops):

- STANDARD (the decomposed core): RMSNorm as ReduceMean/Sqrt/Div, rope as Slice/Mul/Concat over cos/sin computed
  from position_ids (the step model's decomposed form; the full-sequence decomposed graph is
  the torch module's export);
- ONNX (the opset-23 Attention): RMSNormalization-23 and RotaryEmbedding-23, fed cos/sin [batch, seq, dim/2] computed for
  the call's own position_ids (no table: any position);
- CONTRIB (ONNX Runtime's cores): RMSNormalization-23 as its own node (GroupQueryAttention's q_norm_weight/k_norm_weight
  are CUDA/WebGPU only; ONNX Runtime's SimplifiedLayerNormalization is no ONNX op: the checker
  refuses it) and com.microsoft.RotaryEmbedding, fed the same cos/sin as a [batch*seq, dim/2]
  table indexed by arange(batch*seq): each token's row is its own position's, any position.
  The buffer form rotates inside GroupQueryAttention instead (do_rotary, rope_table): its
  positions are token indices, from seqlens_k.

Every form reads the one (inv_freq, attention_factor) pair of attnx.model.rope; the angle is
computed in float32 from position_ids, as transformers does (the tolerance's rope term).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from onnx import TensorProto

from attnx.export._graph import Graph
from attnx.export.terms import GRAPH_TERMS
from attnx.model.config import AttentionConfig
from attnx.model.contract import MS_DOMAIN
from attnx.model.cores import TermOps
from attnx.model.rope import rope_frequencies
from attnx.model.rope import rope_table as cos_sin_table
from attnx.model.terms import terms_at

__all__ = ["norm_and_rotate", "rope_table"]

_F = TensorProto.FLOAT


def norm_and_rotate(
    g: Graph, c: AttentionConfig, weights: Mapping[str, np.ndarray], q: str, k: str, ops: TermOps
) -> tuple[str, str]:
    """q [B, S, H*hd] and k [B, S, Hkv*hd] after the norms before rope (each term's emit_styled: attnx.export.terms)
    and rope, in `ops` (the core's Core.term_ops)."""
    if ops is TermOps.STANDARD:
        return _decomposed(g, c, weights, q, k)
    H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim

    def norm(emit: Any, u: str, heads: int, which: str) -> str:
        u4 = g.op("Reshape", u, g.ints(f"{which}_norm_4d", [0, 0, heads, hd]))  # [B, S, heads, hd]
        normed = emit(g, c, weights, u4, which, False, None)
        return g.op("Reshape", normed, g.ints(f"{which}_norm_3d", [0, 0, heads * hd]), name=g.stage(f"{which}_norm"))

    for name in _styled(c):
        emit = GRAPH_TERMS[name].emit_styled
        q, k = norm(emit, q, H, "q"), norm(emit, k, Hkv, "k")
    if c.rope is not None:
        cos, sin = _rope_cos_sin(g, c)  # [B, S, 1, dim/2]
        attrs = {"rotary_embedding_dim": c.rope.dim, "interleaved": int(c.rope.interleaved)}
        if ops is TermOps.ONNX:  # RotaryEmbedding-23 without position_ids: cos/sin [B, S, dim/2]
            axis2 = g.ints("axes_2", [2])
            cos, sin = g.op("Squeeze", cos, axis2), g.op("Squeeze", sin, axis2)
            q = g.op("RotaryEmbedding", q, cos, sin, num_heads=H, name=g.stage("q_rope"), **attrs)
            k = g.op("RotaryEmbedding", k, cos, sin, num_heads=Hkv, name=g.stage("k_rope"), **attrs)
        else:  # com.microsoft.RotaryEmbedding: a table of B*S rows, token (b, s) reads row b*S + s
            rows = g.ints("rope_rows", [-1, c.rope.dim // 2])
            cos, sin = g.op("Reshape", cos, rows), g.op("Reshape", sin, rows)
            shape = g.op("Shape", "position_ids")
            count = g.op("ReduceProd", shape, keepdims=0)  # scalar B*S
            index = g.op("Reshape", g.op("Range", g.const("zero_i64", np.asarray(0, np.int64)), count,
                                         g.const("one_i64", np.asarray(1, np.int64))), shape)  # fmt: skip
            q = g.op("RotaryEmbedding", q, index, cos, sin, domain=MS_DOMAIN, num_heads=H, name=g.stage("q_rope"),
                     **attrs)  # fmt: skip
            k = g.op("RotaryEmbedding", k, index, cos, sin, domain=MS_DOMAIN, num_heads=Hkv, name=g.stage("k_rope"),
                     **attrs)  # fmt: skip
    return q, k


def _styled(c: AttentionConfig) -> list[str]:
    """The config's terms of place "qk" before rope that each style writes in its own operators (emit_styled)."""
    return [name for name in terms_at(c, "qk") if GRAPH_TERMS[name].emit_styled is not None]


def rope_table(c: AttentionConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """GroupQueryAttention's cos_cache/sin_cache (do_rotary) of the config's rope: attnx.model.rope.rope_table."""
    return cos_sin_table(*rope_frequencies(c.rope), positions)


def _decomposed(g: Graph, c: AttentionConfig, weights: Mapping[str, np.ndarray], q: str, k: str) -> tuple[str, str]:
    """The norms before rope (emit_styled, decomposed) over each head's head_dim and rope as pair i turned by
    position_ids * inv_freq_i, in standard arithmetic ops."""
    H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
    q4 = g.op("Reshape", q, g.ints("q4_shape", [0, 0, H, hd]))  # [B, S, H, hd]
    k4 = g.op("Reshape", k, g.ints("k4_shape", [0, 0, Hkv, hd]))  # [B, S, Hkv, hd]
    for name in _styled(c):
        # with rope the norm's output is held per head only: named there, [B, S, heads, hd]
        q4, k4 = (GRAPH_TERMS[name].emit_styled(g, c, weights, u4, which, True,
                                                g.stage(f"{which}_norm", "b t h d") if c.rope is not None else None)
                  for u4, which in ((q4, "q"), (k4, "k")))  # fmt: skip
    if c.rope is not None:
        cos, sin = _rope_cos_sin(g, c)  # [B, S, 1, dim/2]
        q4, k4 = _rotate(g, c, q4, cos, sin), _rotate(g, c, k4, cos, sin)
    # q and k as scored, [B, S, heads*hd]: the rotation's output, or the norm's without rope
    term = "rope" if c.rope is not None else "norm"
    return (g.op("Reshape", q4, g.ints("q_flat", [0, 0, H * hd]), name=g.stage(f"q_{term}")),
            g.op("Reshape", k4, g.ints("k_flat", [0, 0, Hkv * hd]), name=g.stage(f"k_{term}")))  # fmt: skip


def _rope_cos_sin(g: Graph, c: AttentionConfig) -> tuple[str, str]:
    """cos and sin of position_ids * inv_freq times attention_factor, [B, S, 1, dim/2] float32
    (longrope: its long set for the whole call once max(position_ids) + 1 > the original length)."""
    short, factor = rope_frequencies(c.rope)
    inv_freq = g.const("rope_inv_freq", short.astype(np.float32))
    if c.rope.switch_at is not None:
        original = c.rope.switch_at
        long = rope_frequencies(c.rope, original + 1)[0]
        largest = g.op("ReduceMax", "position_ids", keepdims=0)  # scalar: the call's largest position
        switch = g.op("Greater", largest, g.const("rope_original_minus1", np.asarray(original - 1, np.int64)))
        inv_freq = g.op("Where", switch, g.const("rope_inv_freq_long", long.astype(np.float32)), inv_freq)
    positions = g.op("Unsqueeze", g.op("Cast", "position_ids", to=_F), g.ints("axes_2_3", [2, 3]))  # [B, S, 1, 1]
    angle = g.op("Mul", positions, inv_freq)  # [B, S, 1, dim/2]
    f = g.const("rope_attention_factor", np.asarray(factor, np.float32))
    return g.op("Mul", g.op("Cos", angle), f), g.op("Mul", g.op("Sin", angle), f)


def _rotate(g: Graph, c: AttentionConfig, u: str, cos: str, sin: str) -> str:
    """u [B, S, heads, hd] with pair i of its first rope.dim dims turned by angle i; the rest pass."""
    dim, hd = c.rope.dim, c.head_dim
    last = g.ints("axes_m1", [-1])

    def part(start: int, end: int, step: int = 1) -> str:
        bounds = g.ints(f"s{start}", [start]), g.ints(f"e{end}", [end])
        return g.op("Slice", u, *bounds, last, g.ints(f"st{step}", [step]))

    if c.rope.interleaved:  # pairs (2i, 2i + 1): turned, then woven back [.., dim/2, 2] -> [.., dim]
        a, b = part(0, dim, 2), part(1, dim, 2)
    else:  # pairs (i, i + dim/2)
        a, b = part(0, dim // 2), part(dim // 2, dim)
    a2 = g.op("Sub", g.op("Mul", a, cos), g.op("Mul", b, sin))
    b2 = g.op("Add", g.op("Mul", b, cos), g.op("Mul", a, sin))
    if c.rope.interleaved:
        pairs = g.op("Concat", g.op("Unsqueeze", a2, last), g.op("Unsqueeze", b2, last), axis=-1)
        turned = g.op("Reshape", pairs, g.ints("rot_flat", [0, 0, 0, dim]))
    else:
        turned = g.op("Concat", a2, b2, axis=-1)
    return turned if dim == hd else g.op("Concat", turned, part(dim, hd), axis=-1)
