"""The latent term's graph half (attnx.model.terms.Latent: DeepSeek-V2/V3's multi-head latent attention) in standard
ops, for the decomposed core's emitter: q and the per-token latents from x, the latent cache, and the heads the core
scores, in one of two forms that compute the same q.k and p.v as the formula:

    expanded (the full-sequence graph; a step model's prompt): each head's k and v expanded from the latents by
        kv_b_proj, q [B, S, H*hd] (each head [rope part | nope part]), k [B, H, T, hd], v [B, H, T, vhd]
    absorbed (the step model's decode step): kv_b_proj's k half folded into q and its v half applied to each head's
        output, attention over the latents as one key/value head (the latents read once a step, never expanded):
        q' [B, S, H*(r + R)] = [q's rope part | q_nope W_uk], k = the latents [B, 1, T, r + R],
        v = the latents too, a head's z = (p v)[..., r:] W_uv^T (p.v's compressed kv columns)

A step model holds both behind an If on the call (prompt_expands: whichever costs fewer multiply-adds), as vLLM
expands for a prefill and absorbs for a decode; the cache is written once, outside it.

    latent   [B, 1, T, r + R]  the cache: each token's turned rope key, then its RMS-normed compressed kv
                               (present_latent: past_latent joined before this call's, growing form)

r = rope.dim, R = kv_lora_rank, nope = head_dim - r; W_uk, W_uv: head n's rows of kv_b_proj's k and v halves.
The projections and norms compute in float32, as transformers' DeepseekV3RMSNorm does.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from attnx.export._graph import call_seq, linear
from attnx.export._llm import _rope_cos_sin, _rotate

if TYPE_CHECKING:  # (export.cores' decomposed emitter imports this module)
    from attnx.export.cores._emit import Emit

__all__ = ["Heads", "absorbed", "expanded", "latent_heads", "latent_parts", "prompt_expands"]


class Heads(NamedTuple):
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


def _cut(g: Any, u: str, start: int, end: int) -> str:
    """u[..., start:end]."""
    last = g.ints("latent_axis_last", [-1])
    return g.op("Slice", u, g.ints(f"latent_s{start}", [start]), g.ints(f"latent_e{end}", [end]), last)


def latent_parts(e: Emit) -> tuple[str, str]:
    """(q [B, S, H*hd], each head [turned rope part | nope part]; this call's latents [B, 1, S, r + R]) from x."""
    c, g, w = e.c, e.g, e.weights
    L, r, hd, H = c.latent, c.rope.dim, c.head_dim, c.n_heads
    nope, R = hd - r, c.latent.kv_lora_rank
    last = g.ints("latent_axis_last", [-1])

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
    k_rot = g.op("Unsqueeze", _cut(g, a, R, R + r), g.ints("latent_axis_2", [2]))  # [B, S, 1, r]: one shared key
    cos, sin = _rope_cos_sin(g, c)  # [B, S, 1, r/2]
    turn = types.SimpleNamespace(rope=c.rope, head_dim=r)  # the rotation of a part that is all rope dims
    q_rot, k_rot = _rotate(g, turn, _cut(g, q4, nope, hd), cos, sin), _rotate(g, turn, k_rot, cos, sin)
    q = g.op("Reshape", g.op("Concat", q_rot, _cut(g, q4, 0, nope), axis=-1), g.ints("latent_q3", [0, 0, H * hd]),
             name=g.stage("q_rope"))  # [B, S, H*hd], each head [rope | nope]  # fmt: skip
    latent = g.op("Concat", g.op("Squeeze", k_rot, g.ints("latent_axis_2b", [2])),
                  rms(_cut(g, a, 0, R), "kv_a_layernorm"), axis=-1)  # [B, S, r + R]  # fmt: skip
    return q, g.op("Unsqueeze", latent, g.ints("latent_axis_1", [1]))  # [B, 1, S, r + R]: one "head"


def latent_heads(e: Emit) -> Heads:
    """The heads the decomposed core scores for a latent config's full-sequence graph: the expanded form, kv_b_proj
    one MatMul over this call's latents (what the latent block reader reads back)."""
    c, g, w = e.c, e.g, e.weights
    H, r, nope, R = c.n_heads, c.rope.dim, c.head_dim - c.rope.dim, c.latent.kv_lora_rank
    q, latent = latent_parts(e)
    kv = linear(g, _cut(g, latent, r, r + R), w, "kv_b_proj", False)  # [B, 1, T, H*(nope + vhd)]
    kv = g.op("Transpose", g.op("Reshape", kv, g.ints("latent_kv4", [0, -1, H, nope + c.v_head_dim])),
              perm=[0, 2, 1, 3])  # [B, H, T, nope + vhd]  # fmt: skip
    k_rot = g.op("Expand", _cut(g, latent, 0, r), g.ints("latent_heads", [1, H, 1, 1]))  # [B, H, T, r]
    k = g.op("Concat", k_rot, _cut(g, kv, 0, nope), axis=-1)
    return Heads(q, k, _cut(g, kv, nope, nope + c.v_head_dim), H, c.head_dim, c.v_head_dim)


def _halves(e: Emit) -> tuple[str, str]:
    """kv_b_proj's halves as the step's constants: W_uk [H, nope, R] and W_uv^T [H, R, vhd]."""
    c, g = e.c, e.g
    H, R, nope, vhd = c.n_heads, c.latent.kv_lora_rank, c.head_dim - c.rope.dim, c.v_head_dim
    w_kv = np.asarray(e.weights["kv_b_proj.weight"], np.float32).reshape(H, nope + vhd, R)  # head n: [k_nope | v] rows
    return (g.const("kv_b_proj.k_half", np.ascontiguousarray(w_kv[:, :nope])),
            g.const("kv_b_proj.v_half.T", np.ascontiguousarray(w_kv[:, nope:].transpose(0, 2, 1))))  # fmt: skip


def absorbed(e: Emit, q: str, latents: str) -> Heads:
    """The absorbed form (the module doc) of q [B, S, H*hd] ([rope | nope] heads) and the latents [B, 1, T, r + R]."""
    c, g = e.c, e.g
    H, r, R, hd = c.n_heads, c.rope.dim, c.latent.kv_lora_rank, c.head_dim
    w_uk, w_uv = _halves(e)
    q4 = g.op("Transpose", g.op("Reshape", q, g.ints("latent_q4", [0, 0, H, hd])), perm=[0, 2, 1, 3])  # [B, H, S, hd]
    q_lat = g.op("MatMul", _cut(g, q4, r, hd), w_uk)  # [B, H, S, R]: q_nope W_uk, the nope part scored on the latent
    q_abs = g.op("Transpose", g.op("Concat", _cut(g, q4, 0, r), q_lat, axis=-1), perm=[0, 2, 1, 3])  # [B, S, H, r+R]
    q_abs = g.op("Reshape", q_abs, g.ints("latent_q_abs", [0, 0, H * (r + R)]))

    def finish(z: str) -> str:  # [B, H, S, r + R] -> [B, H, S, vhd]: the compressed kv's columns, each head's W_uv
        return g.op("MatMul", _cut(g, z, r, r + R), w_uv)

    # v: the latents whole, so that the cache is read as it is (a Slice of its compressed kv would copy the cache a
    # step: measurements/mla_decode_gpu); the rope key's columns of p.v are dropped from the small output instead
    return Heads(q_abs, latents, latents, 1, r + R, r + R, finish)


def expanded(e: Emit, q: str, latents: str) -> Heads:
    """The expanded form over the latents [B, 1, T, r + R] from kv_b_proj's halves (the step's constants, stored
    once): k_nope^T = W_uk latent_kv^T per head, v = latent_kv W_uv^T."""
    c, g = e.c, e.g
    H, r, R, hd, vhd = c.n_heads, c.rope.dim, c.latent.kv_lora_rank, c.head_dim, c.v_head_dim
    w_uk, w_uv = _halves(e)
    kv_t = g.op("Transpose", _cut(g, latents, r, r + R), perm=[0, 1, 3, 2])  # [B, 1, R, T]
    k_t = g.op("Concat", g.op("Expand", g.op("Transpose", _cut(g, latents, 0, r), perm=[0, 1, 3, 2]),
                              g.ints("latent_heads", [1, H, 1, 1])),
               g.op("MatMul", w_uk, kv_t), axis=2)  # [B, H, hd, T]: each head's keys [rope | nope], transposed
    v = g.op("MatMul", _cut(g, latents, r, r + R), w_uv)  # [B, H, T, vhd]
    return Heads(q, g.op("Transpose", k_t, perm=[0, 1, 3, 2]), v, H, hd, vhd)


def prompt_expands(e: Emit, latents: str) -> str | None:
    """The bool scalar: whether this call costs fewer multiply-adds expanded than absorbed (None: never, for these
    sizes). Per head, S queries over T keys: expanded, T (nope + vhd) R to expand the keys and S T (hd + vhd) to
    attend; absorbed, S (nope + vhd) R to absorb q and the output and S T 2 (r + R) to attend over the latents. So
    expanded is fewer where S T (2 (r + R) - (hd + vhd)) > (T - S) R (nope + vhd): a prompt (T = S) always, a step
    (S = 1) never past one key; at DeepSeek-V3's sizes a chunk of S after a cache of P where S (P + S) 832 > P 131072."""
    c, g = e.c, e.g
    r, R, hd, vhd = c.rope.dim, c.latent.kv_lora_rank, c.head_dim, c.v_head_dim
    per_pair, per_key = 2 * (r + R) - (hd + vhd), R * (hd - r + vhd)
    if per_pair <= 0:
        return None
    seq = call_seq(g)  # S
    total = g.op("Squeeze", g.op("Shape", latents, start=2, end=3), g.ints("axis0b", [0]))  # T
    pairs = g.op("Mul", g.op("Mul", seq, total), g.const("latent_per_pair", np.asarray(per_pair, np.int64)))
    keys = g.op("Mul", g.op("Sub", total, seq), g.const("latent_per_key", np.asarray(per_key, np.int64)))
    return g.op("Greater", pairs, keys)
