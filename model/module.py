"""The torch module: scaled dot-product multi-head attention, self or cross, with masks, and the
modern LLM terms (docs/concepts/formula.md, "Modern LLM attention"): qk_norm, rope, softcap, ALiBi, sliding window, sinks.

The terms of the formula are the registry's (attnx.model.terms.TERMS), each computed here by its
entry's torch function (Term.torch; the numpy reference's is Term.reference), in the formula's order:

    qk       (module, q [B, T, N, hd], k [B, S, Nkv, hd], position_ids, query token indices [T]) -> (q, k)
    scores   (module, scores [B, N, T, S], query token indices [T], key token indices [S]) -> scores
    mask     (module, query token indices [T], key token indices [S], key_padding_mask [B, S] | None)
             -> hidden bool, broadcastable to [B, N, T, S]
    softmax  (module, scores [B, N, T, S]) -> more logits [B, N, T, E], with no value
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnx.errors import UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import TORCH_CORES, sdpa_core_expresses
from attnx.model.rope import rope_frequencies
from attnx.model.terms import PLACES, TERMS, projection_shapes
from attnx.model.weights import check_weights, init_weights

__all__ = ["MultiHeadAttention", "build_module"]


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last axis (head_dim): x / sqrt(mean(x^2) + eps) * weight, computed in
    float32 at least (as transformers' Qwen3RMSNorm), returned in x's dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if x.dtype == torch.float64 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.to(h.dtype)).to(x.dtype)


class MultiHeadAttention(nn.Module):
    def __init__(self, config: AttentionConfig, core: str = "decomposed") -> None:
        """core: how the attention core is written in torch (the contract's TORCH_CORES). Each
        exports to a different ONNX form: "decomposed": MatMul, Softmax, MatMul (any opset);
        "sdpa": F.scaled_dot_product_attention, which the dynamo exporter turns into the
        standard Attention op at opset 23."""
        super().__init__()
        if core not in TORCH_CORES:
            raise UsageError(f"unknown attention core {core!r} (known: {', '.join(TORCH_CORES)})")
        self.config = config
        self.core = core
        # The config's terms by their place in the formula (attnx.model.terms), each computed by its Term.torch.
        self._terms = {place: [t for t in config.terms if TERMS[t].place == place] for place in PLACES}
        # Localisation (attnx.runtimes.localise): a dict to fill with each stage's value as this module
        # computes it (attnx.model.stages, canonical layouts), or None (always while exporting).
        self.stages: dict[str, torch.Tensor] | None = None
        c = config
        # q_proj, k_proj, v_proj (n_kv_heads heads), or the latent's (attnx.model.terms: projection_shapes)
        for name, ((out_f, in_f), biased) in projection_shapes(c).items():
            setattr(self, name, nn.Linear(in_f, out_f, bias=c.bias and biased))
        if c.latent is not None:  # the latents' RMSNorms (transformers' DeepseekV3RMSNorm: float32 at least)
            if c.latent.q_lora_rank is not None:
                self.q_a_layernorm = HeadRMSNorm(c.latent.q_lora_rank, c.latent.eps)
            self.kv_a_layernorm = HeadRMSNorm(c.latent.kv_lora_rank, c.latent.eps)
        self.out_proj = nn.Linear(c.v_dim, c.d_model, bias=c.bias)
        if c.qk_norm is not None:
            self.q_norm = HeadRMSNorm(c.head_dim, c.qk_norm.eps)
            self.k_norm = HeadRMSNorm(c.head_dim, c.qk_norm.eps)
        if c.sinks:
            self.sinks = nn.Parameter(torch.zeros(c.n_heads))
        if core == "sdpa" and not sdpa_core_expresses(c):
            # F.scaled_dot_product_attention has neither: the sdpa core would drop them silently.
            raise UsageError(
                f"the sdpa core has no {'softcap' if c.softcap is not None else 'sinks'}: use the decomposed core"
            )
        # The rope table's pair (attnx.model.rope), held as numpy (the module is built on the meta
        # device) and made a tensor in forward: a constant of the exported graph. longrope keeps
        # both sets and picks one per call (_rope_inv_freq).
        self._rope = None
        if c.rope is not None:
            short, factor = rope_frequencies(c.rope)
            long = None
            if c.rope.switch_at is not None:
                long = rope_frequencies(c.rope, c.rope.switch_at + 1)[0]
            self._rope = (short, long, factor)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        past_key: torch.Tensor | None = None,
        past_value: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_latent: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """y; with config.kv_cache the step model: (y, present_key, present_value), where the
        present cache is the past one with this step's keys/values appended (docs/concepts/step-forms.md),
        keys as they are scored (after qk_norm and rope). position_ids [B, T] int64: each token's
        position, for config.rope. With config.latent the cache is the latents: past_latent in, (y, present_latent)
        out (attnx.model.terms.Latent)."""
        c = self.config
        B, T, _ = x.shape
        m = memory if c.cross else x
        S = m.shape[1]
        record = self._record
        if c.latent is not None:
            q, k = TERMS["latent"].torch[0](self, x)  # (B, T, N, hd), (B, T, 1, w): the latents
            past_key = past_latent  # what the cache holds, joined below
        else:
            q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim)  # (B, T, N, hd)
            k = self.k_proj(m).view(B, S, c.n_kv_heads, c.head_dim)  # (B, S, Nkv, hd)
        record("q", q), record("k", k)
        if c.rope is not None and position_ids is None:
            raise UsageError("this model takes position_ids (config rope)")
        past = past_key.shape[2] if c.kv_cache and past_key is not None else 0
        tokens = torch.arange(T, device=x.device) + past  # the queries' token indices
        for term in self._terms["qk"]:  # qk_norm, rope, ...
            q, k = TERMS[term].torch(self, q, k, position_ids, tokens)
            if TERMS[term].stage is not None:
                record(f"q_{TERMS[term].stage}", q), record(f"k_{TERMS[term].stage}", k)
        q = q.transpose(1, 2)  # (B, N, T, hd)
        k = k.transpose(1, 2)  # (B, Nkv, S, hd); the latents (B, 1, S, w)
        if c.latent is not None:
            if c.kv_cache:
                if past_latent is None:
                    raise UsageError("this step model takes past_latent (past_seq 0 for a prefill)")
                k = torch.cat([past_latent.to(k.dtype), k], dim=2)  # (B, 1, P+S, w): every position so far
            present = (k,)
            k, v = TERMS["latent"].torch[1](self, k)  # (B, N, L, hd), (B, N, L, vhd)
        else:
            v = self.v_proj(m).view(B, S, c.n_kv_heads, c.v_head_dim)
            record("v", v)
            v = v.transpose(1, 2)  # (B, Nkv, S, vhd)
            if c.kv_cache:
                if past_key is None or past_value is None:
                    raise UsageError("this step model takes past_key and past_value (past_seq 0 for a prefill)")
                k = torch.cat([past_key.to(k.dtype), k], dim=2)  # (B, Nkv, P+S, hd): every position so far
                v = torch.cat([past_value.to(v.dtype), v], dim=2)
            present = (k, v)
        if c.group_size > 1:
            # Query head n reads key/value head n // group_size.
            k = k.repeat_interleave(c.group_size, dim=1)  # (B, N, L, hd)
            v = v.repeat_interleave(c.group_size, dim=1)  # (B, N, L, vhd)
        L = k.shape[2]

        hidden = self._hidden_keys(x, T, L, key_padding_mask, past)  # (B|1, 1, T|1, L) bool or None
        if self.core == "sdpa":
            z = self._sdpa(q, k, v, hidden)
        else:
            z = self._decomposed(q, k, v, hidden)
        if hidden is not None:
            # A query whose keys are all hidden gets z = 0 (docs/concepts/formula.md). torch.where
            # rather than a product, so that a NaN from a backend's softmax cannot leak through.
            any_visible = ~hidden.all(dim=-1, keepdim=True)  # (B|1, 1, T|1, 1)
            z = torch.where(any_visible, z, torch.zeros((), dtype=z.dtype))
        z = z.transpose(1, 2).reshape(B, T, c.v_dim)  # (B, T, N*vhd), heads concatenated
        y = self.out_proj(z)
        record("z", z), record("y", y)
        if c.kv_cache:
            for spec, value in zip(c.cache_specs(prefix="present_"), present):
                record(spec.name, value)
            return (y, *present)
        return y

    def _record(self, stage: str, value: torch.Tensor) -> None:
        """Keep `stage`'s value when localisation asks (self.stages), in the canonical layout: a
        per-head q/k/v (B, T, heads, dim) is flattened to (B, T, heads * dim)."""
        if self.stages is None:
            return
        if value.dim() == 4 and stage in ("q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope"):
            value = value.flatten(2)
        self.stages[stage] = value.detach()

    def _rope_cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of position * inv_freq, times attention_factor, (B, T, 1, dim/2) in `dtype`.
        The angle is computed in float32 (float64 for a float64 module), as transformers does: its
        rounding grows with the position (the tolerance table's rope term)."""
        short, long, factor = self._rope
        angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = torch.tensor(short, dtype=angle_dtype, device=position_ids.device)
        if long is not None:
            # longrope, transformers' rule: the long factors for the whole call once its largest
            # position + 1 exceeds the original length.
            switch = position_ids.max() + 1 > self.config.rope.switch_at
            inv_freq = torch.where(switch, torch.tensor(long, dtype=angle_dtype, device=position_ids.device), inv_freq)
        angle = position_ids.to(angle_dtype)[..., None, None] * inv_freq  # (B, T, 1, dim/2)
        return (angle.cos() * factor).to(dtype), (angle.sin() * factor).to(dtype)

    def _rotate(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """u (B, T, heads, hd) with pair i of its first rope.dim dims turned by angle i; the rest pass."""
        rope = self.config.rope
        rot, rest = u[..., : rope.dim], u[..., rope.dim :]
        if rope.interleaved:  # pairs (2i, 2i + 1)
            a, b = rot[..., 0::2], rot[..., 1::2]
            turned = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)  # (.., dim)
        else:  # pairs (i, i + dim/2)
            a, b = rot[..., : rope.dim // 2], rot[..., rope.dim // 2 :]
            turned = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        return torch.cat((turned, rest), dim=-1) if rest.shape[-1] else turned

    def _hidden_keys(
        self, x: torch.Tensor, T: int, S: int, key_padding_mask: torch.Tensor | None, past: int = 0
    ) -> torch.Tensor | None:
        """True where key j is hidden from query i, broadcastable to (B, N, T, S): the union of what
        each mask term hides (Term.torch). With a cache, query i sits at token index past + i and key
        j at index j: the mask is over token index (never over position_ids)."""
        if self.config.key_padding_mask and key_padding_mask is None:
            raise UsageError("this model takes a key_padding_mask input")
        i = torch.arange(T, device=x.device) + past  # query token indices
        j = torch.arange(S, device=x.device)  # key token indices (S = past + T)
        hidden = None
        for term in self._terms["mask"]:
            h = TERMS[term].torch(self, i, j, key_padding_mask)
            hidden = h if hidden is None else hidden | h
        return hidden

    def _decomposed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        c = self.config
        scores = torch.matmul(q, k.transpose(-2, -1)) * c.softmax_scale  # (B, N, T, S)
        if self._terms["scores"]:
            T, S = scores.shape[-2:]
            i = torch.arange(T, device=q.device) + (S - T)  # query token indices (a step's after its past)
            j = torch.arange(S, device=q.device)
            for term in self._terms["scores"]:  # softcap
                scores = TERMS[term].torch(self, scores, i, j)
        self._record("scores", scores)
        if hidden is not None:
            # The dtype's lowest finite value, not -inf: exp(lowest - max) is exactly 0 for a
            # hidden key, and a fully hidden row stays finite (fp16 included).
            scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        extra = [TERMS[term].torch(self, scores) for term in self._terms["softmax"]]  # sinks
        if extra:
            n = scores.shape[-1]
            p = torch.softmax(torch.cat((scores, *extra), dim=-1), dim=-1)[..., :n]  # more logits, no value
        else:
            p = torch.softmax(scores, dim=-1)
        self._record("probs", p)
        return torch.matmul(p, v)  # (B, N, T, vhd)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        scale = self.config.softmax_scale
        if self._terms["scores"]:  # ALiBi: the score terms SDPA takes, as its additive float mask
            B, N, T, _ = q.shape
            S = k.shape[2]
            bias = q.new_zeros(1, N, T, S)
            i, j = torch.arange(T, device=q.device) + (S - T), torch.arange(S, device=q.device)
            for term in self._terms["scores"]:
                bias = TERMS[term].torch(self, bias, i, j)
            mask = bias if hidden is None else bias.masked_fill(hidden, torch.finfo(bias.dtype).min)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        if hidden is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        c = self.config
        only = self._terms["mask"]
        if len(only) == 1 and TERMS[only[0]].sdpa_is_causal and not c.kv_cache:
            # (is_causal aligns the mask top-left: right only without a cache, where T == S.)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        # The mask is expanded to (B, 1, T, S): ONNX Runtime's Attention op does not
        # broadcast a query axis of size 1 in attn_mask.
        B, _, T, _ = q.shape
        S = k.shape[2]
        attend = (~hidden).expand(B, 1, T, S)  # SDPA's boolean mask: True = attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale)

    @torch.no_grad()
    def load_numpy_weights(self, weights: Mapping[str, np.ndarray], share: bool = False) -> MultiHeadAttention:
        """Copy the weights in, or with share=True make the parameters views of the numpy
        arrays (no copy: the gpt3 preset's 2.4 GB are then held once, not twice)."""
        check_weights(self.config, weights)
        state = {}
        for name, value in weights.items():
            array = np.ascontiguousarray(value, dtype=np.float32)
            if share and not array.flags.writeable:
                array = array.copy()  # torch tensors are writable; a read-only buffer cannot back one
            state[name] = torch.from_numpy(array)
        self.load_state_dict(state, strict=True, assign=share)
        return self


def build_module(
    config: AttentionConfig,
    weights: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    core: str = "decomposed",
) -> MultiHeadAttention:
    """The module in eval mode with the given weights, or seeded ones."""
    # Build on the meta device: the seeded numpy weights replace torch's own init, which
    # for the gpt3 preset would otherwise cost seconds and 2.4 GB for nothing. The parameters
    # share the numpy arrays' memory (float32, contiguous): no second copy of the weights.
    with torch.device("meta"):
        module = MultiHeadAttention(config, core)
    module.load_numpy_weights(weights if weights is not None else init_weights(config, seed), share=True)
    return module.eval()
