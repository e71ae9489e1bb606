"""latent: multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, MiniCPM3; transformers' DeepseekV3Attention),
the heads term that computes q, k and v itself and whose cache is the latent."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import ConfigError
from attnx.model.rope import parse_rope
from attnx.model.terms._base import Config, Setter, Term, Weights, check_int, check_number, linear, matmul, rms


@dataclasses.dataclass(frozen=True)
class Latent:
    """The config's `latent`: multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2, MiniCPM3; transformers'
    DeepseekV3Attention). q from x (q_proj) or through a low-rank latent (q_a_proj to q_lora_rank, RMSNorm
    q_a_layernorm, q_b_proj); k and v from one latent per token, kv_a_proj_with_mqa's [compressed kv (kv_lora_rank,
    RMSNorm kv_a_layernorm) | one shared rope key (rope.dim)], the compressed kv expanded by kv_b_proj to each head's
    [k_nope (head_dim - rope.dim) | v (v_head_dim)]. A head's q and k are laid out [rope part | nope part] (the rope
    term turns a head's first rope.dim dims; a permutation of the dims leaves q.k unchanged); the cache holds the
    latent, [rotated rope key | normed compressed kv], one "head" of rope.dim + kv_lora_rank per token."""

    kv_lora_rank: int
    q_lora_rank: int | None
    eps: float  # the RMSNorms' (transformers' DeepseekV3RMSNorm default, 1e-6: not rms_norm_eps)

    def to_dict(self) -> dict[str, Any]:
        return {"kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank, "eps": self.eps}


def _validate(c: Config, set_: Setter) -> None:
    if c.latent is None:
        return
    value = c.latent.to_dict() if isinstance(c.latent, Latent) else c.latent
    if not isinstance(value, dict) or set(value) != {"kv_lora_rank", "q_lora_rank", "eps"}:
        raise ConfigError('config key \'latent\' must be null or an object {"kv_lora_rank": int, "q_lora_rank": '
                          f'int or null, "eps": number}}, got {c.latent!r}')  # fmt: skip
    check_int("latent.kv_lora_rank", value["kv_lora_rank"])
    if value["q_lora_rank"] is not None:
        check_int("latent.q_lora_rank", value["q_lora_rank"])
    latent = Latent(value["kv_lora_rank"], value["q_lora_rank"], check_number("latent.eps", value["eps"]))
    set_("latent", latent)
    if c.rope is None:
        raise ConfigError("config key 'latent' needs 'rope': its shared key part is the rope's dims (rope.dim)")
    rope = parse_rope(c.rope, c.head_dim)  # (the rope term's normal form, set when its own keys are validated)
    if rope.dim >= c.head_dim:
        raise ConfigError(f"config key 'latent' needs rope.dim ({rope.dim}) below head_dim ({c.head_dim}): a head "
                          "is [rope part | nope part], the nope part from the compressed kv")  # fmt: skip
    if c.n_kv_heads != c.n_heads:
        raise ConfigError(f"config key 'latent' expands the latent to every head's k and v: n_kv_heads "
                          f"({c.n_kv_heads}) must equal n_heads ({c.n_heads})")  # fmt: skip
    for key in ("cross", "qk_norm", "qk_l2_norm"):
        if getattr(c, key) not in (None, False):
            raise ConfigError(f"config keys 'latent' and {key!r} do not go together (no model attnx imports has both)")


def _projections(c: Config) -> dict[str, tuple[tuple[int, int], bool]]:
    """transformers' DeepseekV3Attention's projections (attention_bias on q_a_proj, kv_a_proj_with_mqa and o_proj)."""
    L, nope = c.latent, c.head_dim - c.rope.dim
    q = ({"q_proj": ((c.q_dim, c.d_model), True)} if L.q_lora_rank is None else
         {"q_a_proj": ((L.q_lora_rank, c.d_model), True), "q_b_proj": ((c.q_dim, L.q_lora_rank), False)})
    return {**q, "kv_a_proj_with_mqa": ((L.kv_lora_rank + c.rope.dim, c.d_model), True),
            "kv_b_proj": ((c.n_heads * (nope + c.v_head_dim), L.kv_lora_rank), False)}  # fmt: skip


def _norms(c: Config) -> dict[str, tuple[tuple[int, ...], tuple[float, float]]]:
    L = c.latent
    q = {} if L.q_lora_rank is None else {"q_a_layernorm.weight": ((L.q_lora_rank,), (0.5, 1.5))}
    return {**q, "kv_a_layernorm.weight": ((L.kv_lora_rank,), (0.5, 1.5))}


def _roll_latent_heads(c: Config, w: Weights) -> tuple[Config, Weights]:
    """Head n's k_nope and v expanded with head n+1's rows of kv_b_proj."""
    out = dict(w)
    rows = np.asarray(w["kv_b_proj.weight"]).reshape(c.n_heads, -1, c.latent.kv_lora_rank)
    out["kv_b_proj.weight"] = np.roll(rows, 1, axis=0).reshape(w["kv_b_proj.weight"].shape)
    return c, out


# The numpy reference's pair ------------------------------------------------------------------------------------
def project(c: Config, w: Mapping[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q [b, t, N, hd], each head [rope part | nope part], and each token's latent [b, t, 1, rope.dim +
    kv_lora_rank]: [its rope key (one, shared by every head) | its compressed kv, RMS-normed] (Latent)."""
    L, r = c.latent, c.rope.dim
    nope = c.head_dim - r
    if L.q_lora_rank is None:
        q = linear(c, w, x, "q_proj")
    else:
        qa = rms(linear(c, w, x, "q_a_proj"), L.eps) * np.asarray(w["q_a_layernorm.weight"], x.dtype)  # (b, t, qr)
        q = matmul(w, qa, "q_b_proj")
    q = q.reshape(*q.shape[:2], c.n_heads, c.head_dim)  # transformers' head: [nope | rope]
    q = np.concatenate([q[..., nope:], q[..., :nope]], axis=-1)  # [rope | nope]
    a = linear(c, w, x, "kv_a_proj_with_mqa")  # (b, t, kv_lora_rank + r): [compressed kv | rope key]
    kv = rms(a[..., : L.kv_lora_rank], L.eps) * np.asarray(w["kv_a_layernorm.weight"], x.dtype)
    return q, np.concatenate([a[..., L.kv_lora_rank :], kv], axis=-1)[:, :, None, :]


def expand(c: Config, w: Mapping[str, np.ndarray], latent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """k [b, s, N, hd] ([the shared rope key | the head's k_nope]) and v [b, s, N, vhd] of the (cached) latents
    [b, s, 1, rope.dim + kv_lora_rank]: kv_b_proj expands the compressed kv to each head's [k_nope | v]."""
    r, nope = c.rope.dim, c.head_dim - c.rope.dim
    kv = matmul(w, latent[:, :, 0, r:], "kv_b_proj").reshape(*latent.shape[:2], c.n_heads, nope + c.v_head_dim)
    k_rot = np.broadcast_to(latent[..., :r], (*latent.shape[:2], c.n_heads, r))
    return np.concatenate([k_rot, kv[..., :nope]], axis=-1), kv[..., nope:]


# The torch module's pair (its layers: attnx.model.module) -------------------------------------------------------
def torch_project(m: Any, x: Any) -> tuple[Any, Any]:
    """q (B, T, N, hd), each head [rope part | nope part], and the latents (B, T, 1, rope.dim + kv_lora_rank):
    [the rope key | the normed compressed kv] (Latent; transformers' DeepseekV3Attention)."""
    import torch

    c = m.config
    B, T, _ = x.shape
    r, kvr = c.rope.dim, c.latent.kv_lora_rank
    nope = c.head_dim - r
    q = m.q_proj(x) if c.latent.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
    q = q.view(B, T, c.n_heads, c.head_dim)  # transformers' head: [nope | rope]
    q = torch.cat((q[..., nope:], q[..., :nope]), dim=-1)  # [rope | nope]: the rope term turns the first dims
    a = m.kv_a_proj_with_mqa(x)  # (B, T, kvr + r): [compressed kv | rope key]
    latent = torch.cat((a[..., kvr:], m.kv_a_layernorm(a[..., :kvr])), dim=-1)
    return q, latent.view(B, T, 1, r + kvr)


def torch_expand(m: Any, latent: Any) -> tuple[Any, Any]:
    """k (B, N, L, hd) [the shared rope key | the head's k_nope] and v (B, N, L, vhd) of the latents (B, 1, L, w):
    kv_b_proj expands the compressed kv to each head's [k_nope | v]."""
    import torch

    c = m.config
    B, _, L, _ = latent.shape
    r, nope = c.rope.dim, c.head_dim - c.rope.dim
    kv = m.kv_b_proj(latent[:, 0, :, r:]).view(B, L, c.n_heads, nope + c.v_head_dim).transpose(1, 2)
    k_rot = latent[..., :r].expand(B, c.n_heads, L, r)
    return torch.cat((k_rot, kv[..., :nope]), dim=-1), kv[..., nope:]


TERM = Term("latent", ("latent",), "heads",
            "multi-head latent attention (MLA): q through a low-rank latent, k and v expanded from one cached latent "
            "per token (kv_lora_rank + rope.dim), its rope part one key shared by every head",
            lambda c: c.latent is not None, _validate, tensors=_norms,
            tolerance="none: K is the longest of d_model, the ranks and head_dim (each a reduction it covers)",
            fault=_roll_latent_heads, fault_summary="kv_b_proj's heads rolled by one", modern=True,
            projections=_projections,
            says=lambda c: [f"kv_lora_rank {c.latent.kv_lora_rank}", f"q_lora_rank {c.latent.q_lora_rank}"
                            if c.latent.q_lora_rank is not None else "q_proj"],
            reference=(project, expand), torch=(torch_project, torch_expand))  # fmt: skip
