"""The latent term's graph half (attnx.model.terms.Latent: DeepSeek-V2/V3's multi-head latent attention) in standard
ops, for the decomposed core's emitter: q and the per-token latents from x, the latent cache, and the heads the core
scores, in one of two forms that compute the same q.k and p.v as the formula:

    expanded (the full-sequence graph): each head's k and v expanded from the latents by kv_b_proj,
        q [B, S, H*hd] (each head [rope part | nope part]), k [B, H, T, hd], v [B, H, T, vhd]
    absorbed (the step model: decode): kv_b_proj's k half folded into q and its v half applied to each head's
        output, attention over the latents as one key/value head (the latents read once a step, never expanded):
        q' [B, S, H*(r + R)] = [q's rope part | q_nope W_uk], k = the latents [B, 1, T, r + R],
        v = the latents too, a head's z = (p v)[..., r:] W_uv^T (p.v's compressed kv columns)

    latent   [B, 1, T, r + R]  the cache: each token's turned rope key, then its RMS-normed compressed kv
                               (present_latent: past_latent joined before this call's, growing form)

r = rope.dim, R = kv_lora_rank, nope = head_dim - r; W_uk, W_uv: head n's rows of kv_b_proj's k and v halves.
The projections and norms compute in float32, as transformers' DeepseekV3RMSNorm does.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from attnx.export._graph import linear
from attnx.export._llm import _rope_cos_sin, _rotate

if TYPE_CHECKING:  # (export.cores' decomposed emitter imports this module)
    from attnx.export.cores._emit import Emit

__all__ = ["LatentHeads", "latent_heads"]


class LatentHeads(NamedTuple):
    """What the core scores (the module doc's two forms): q [B, S, H * qk_dim], k [B, kv_heads, T, qk_dim], v
    [B, kv_heads, T, v_dim], and `finish`, which makes the heads' outputs [B, H, S, v_dim] each head's z [B, H, S,
    v_head_dim] (None: they are)."""

    q: str
    k: str
    v: str
    kv_heads: int
    qk_dim: int
    v_dim: int
    finish: Callable[[str], str] | None = None


def latent_heads(e: Emit) -> LatentHeads:
    """The heads the decomposed core scores for a latent config: the expanded form in the full-sequence graph, the
    absorbed form in the step model (the module doc), from the latents of the cache and this call."""
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
    if e.step:  # the cache's latents and this call's, [B, 1, T, r + R] (growing: joined; buffer: written in place)
        return _absorbed(e, q, e.cached("past_latent", latent, "present_latent"), cut)
    kv = linear(g, cut(latent, r, r + R), w, "kv_b_proj", False)  # [B, 1, T, H*(nope + vhd)]
    kv = g.op("Transpose", g.op("Reshape", kv, g.ints("latent_kv4", [0, -1, H, nope + c.v_head_dim])),
              perm=[0, 2, 1, 3])  # [B, H, T, nope + vhd]  # fmt: skip
    k_rot = g.op("Expand", cut(latent, 0, r), g.ints("latent_heads", [1, H, 1, 1]))  # [B, H, T, r]
    k = g.op("Concat", k_rot, cut(kv, 0, nope), axis=-1)
    return LatentHeads(q, k, cut(kv, nope, nope + c.v_head_dim), H, hd, c.v_head_dim)


def _absorbed(e: Emit, q: str, latent: str, cut: Callable[[str, int, int], str]) -> LatentHeads:
    """The absorbed form (the module doc) of q [B, S, H*hd] ([rope | nope] heads) and the latents [B, 1, T, r + R]."""
    c, g = e.c, e.g
    H, r, R, hd, vhd = c.n_heads, c.rope.dim, c.latent.kv_lora_rank, c.head_dim, c.v_head_dim
    nope = hd - r
    w_kv = np.asarray(e.weights["kv_b_proj.weight"], np.float32).reshape(H, nope + vhd, R)  # head n: [k_nope | v] rows
    w_uk = g.const("kv_b_proj.k_half", np.ascontiguousarray(w_kv[:, :nope]))  # [H, nope, R]
    w_uv = g.const("kv_b_proj.v_half.T", np.ascontiguousarray(w_kv[:, nope:].transpose(0, 2, 1)))  # [H, R, vhd]
    q4 = g.op("Transpose", g.op("Reshape", q, g.ints("latent_q4", [0, 0, H, hd])), perm=[0, 2, 1, 3])  # [B, H, S, hd]
    q_lat = g.op("MatMul", cut(q4, r, hd), w_uk)  # [B, H, S, R]: q_nope W_uk, the nope part scored on the latent
    q_abs = g.op("Transpose", g.op("Concat", cut(q4, 0, r), q_lat, axis=-1), perm=[0, 2, 1, 3])  # [B, S, H, r + R]
    q_abs = g.op("Reshape", q_abs, g.ints("latent_q_abs", [0, 0, H * (r + R)]))

    def finish(z: str) -> str:  # [B, H, S, r + R] -> [B, H, S, vhd]: the compressed kv's columns, each head's W_uv
        return g.op("MatMul", cut(z, r, r + R), w_uv)

    # v: the latents whole, so that the cache is read as it is (a Slice of its compressed kv would copy the cache a
    # step: measurements/mla_decode_gpu); the rope key's columns of p.v are dropped from the small output instead
    return LatentHeads(q_abs, latent, latent, 1, r + R, r + R, finish)
