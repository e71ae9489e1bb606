"""The latent term's graph half (attnx.model.terms.Latent: DeepSeek-V2/V3's multi-head latent attention) in standard
ops, for the decomposed core's emitter: q and the per-token latents from x, the latent cache, and each head's k and v
expanded from it (the expanded form: the same q.k and p.v as the formula, every head's keys and values computed).

    q        [B, S, H*hd]   each head [rope part | nope part], the rope part turned (attnx.export._llm's rotation)
    latent   [B, 1, T, r + R]  the cache: each token's turned rope key, then its RMS-normed compressed kv
                               (present_latent: past_latent joined before this call's, growing form)
    k, v     [B, H, T, hd], [B, H, T, vhd]  kv_b_proj's MatMul of the compressed kv, the rope key repeated per head

r = rope.dim, R = kv_lora_rank, nope = head_dim - r. The projections and norms compute in float32, as
transformers' DeepseekV3RMSNorm does.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import numpy as np

from attnx.export._graph import linear
from attnx.export._llm import _rope_cos_sin, _rotate

if TYPE_CHECKING:  # (export.cores' decomposed emitter imports this module)
    from attnx.export.cores._emit import Emit

__all__ = ["latent_heads"]


def latent_heads(e: Emit) -> tuple[str, str, str]:
    """q [B, S, H*hd] as scored, and the keys and values every query is scored against, per head: present_k
    [B, H, T, hd] and present_v [B, H, T, vhd], expanded from the latents (the cache's and this call's)."""
    c, g, w = e.c, e.g, e.weights
    L, r, hd, H = c.latent, c.rope.dim, c.head_dim, c.n_heads
    nope, R = hd - r, c.latent.kv_lora_rank
    last = g.ints("latent_axis_last", [-1])

    def cut(u: str, start: int, end: int) -> str:  # u[..., start:end]
        return g.op("Slice", u, g.ints(f"latent_s{start}", [start]), g.ints(f"latent_e{end}", [end]), last)

    def rms(u: str, name: str) -> str:  # u / sqrt(mean(u^2) + eps) * weight, over the last axis
        eps = g.const("latent_eps", np.asarray(L.eps, np.float32))
        mean_sq = g.op("ReduceMean", g.op("Mul", u, u), last, keepdims=1)
        weight = g.const(f"{name}.weight", np.asarray(w[f"{name}.weight"], np.float32))
        return g.op("Mul", g.op("Div", u, g.op("Sqrt", g.op("Add", mean_sq, eps))), weight)

    if L.q_lora_rank is None:
        q = linear(g, "x", w, "q_proj", c.bias)
    else:
        q = linear(g, rms(linear(g, "x", w, "q_a_proj", c.bias), "q_a_layernorm"), w, "q_b_proj", False)
    q4 = g.op("Reshape", q, g.ints("latent_q4", [0, 0, H, hd]))  # transformers' head: [nope | rope]
    a = linear(g, "x", w, "kv_a_proj_with_mqa", c.bias)  # [B, S, R + r]: [compressed kv | rope key]
    k_rot = g.op("Unsqueeze", cut(a, R, R + r), g.ints("latent_axis_2", [2]))  # [B, S, 1, r]: one shared key
    cos, sin = _rope_cos_sin(g, c)  # [B, S, 1, r/2]
    turn = types.SimpleNamespace(rope=c.rope, head_dim=r)  # the rotation of a part that is all rope dims
    q_rot, k_rot = _rotate(g, turn, cut(q4, nope, hd), cos, sin), _rotate(g, turn, k_rot, cos, sin)
    q = g.op("Reshape", g.op("Concat", q_rot, cut(q4, 0, nope), axis=-1), g.ints("latent_q3", [0, 0, H * hd]),
             name=g.stage("q_rope"))  # [B, S, H*hd], each head [rope | nope]  # fmt: skip
    latent = g.op("Concat", g.op("Squeeze", k_rot, g.ints("latent_axis_2b", [2])), rms(cut(a, 0, R), "kv_a_layernorm"),
                  axis=-1)  # [B, S, r + R]  # fmt: skip
    latent = g.op("Unsqueeze", latent, g.ints("latent_axis_1", [1]))  # [B, 1, S, r + R]: one "head"
    if e.step:
        latent = g.op("Concat", "past_latent", latent, axis=2, name="present_latent")  # [B, 1, T, r + R]
    kv = linear(g, cut(latent, r, r + R), w, "kv_b_proj", False)  # [B, 1, T, H*(nope + vhd)]
    kv = g.op("Transpose", g.op("Reshape", kv, g.ints("latent_kv4", [0, -1, H, nope + c.v_head_dim])),
              perm=[0, 2, 1, 3])  # [B, H, T, nope + vhd]  # fmt: skip
    k_rot = g.op("Expand", cut(latent, 0, r), g.ints("latent_heads", [1, H, 1, 1]))  # [B, H, T, r]
    return q, g.op("Concat", k_rot, cut(kv, 0, nope), axis=-1), cut(kv, nope, nope + c.v_head_dim)
