"""The torch module: scaled dot-product multi-head attention, self or cross, with masks."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnx.errors import UsageError
from attnx.model.config import AttentionConfig
from attnx.model.contract import TORCH_CORES
from attnx.model.weights import check_weights, init_weights

__all__ = ["MultiHeadAttention", "build_module"]



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
        c = config
        self.q_proj = nn.Linear(c.d_model, c.q_dim, bias=c.bias)
        self.k_proj = nn.Linear(c.kv_dim, c.kv_q_dim, bias=c.bias)  # n_kv_heads heads
        self.v_proj = nn.Linear(c.kv_dim, c.kv_v_dim, bias=c.bias)
        self.out_proj = nn.Linear(c.v_dim, c.d_model, bias=c.bias)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        past_key: torch.Tensor | None = None,
        past_value: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """y; with config.kv_cache the step model: (y, present_key, present_value), where the
        present cache is the past one with this step's keys/values appended (README, "Decoding")."""
        c = self.config
        B, T, _ = x.shape
        m = memory if c.cross else x
        S = m.shape[1]
        q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, N, T, hd)
        k = self.k_proj(m).view(B, S, c.n_kv_heads, c.head_dim).transpose(1, 2)  # (B, Nkv, S, hd)
        v = self.v_proj(m).view(B, S, c.n_kv_heads, c.v_head_dim).transpose(1, 2)  # (B, Nkv, S, vhd)
        past = 0
        if c.kv_cache:
            if past_key is None or past_value is None:
                raise UsageError("this step model takes past_key and past_value (past_seq 0 for a prefill)")
            past = past_key.shape[2]
            k = torch.cat([past_key.to(k.dtype), k], dim=2)  # (B, Nkv, P+S, hd): every position so far
            v = torch.cat([past_value.to(v.dtype), v], dim=2)
        present_k, present_v = k, v
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
            # A query whose keys are all hidden gets z = 0 (README, "The model"). torch.where
            # rather than a product, so that a NaN from a backend's softmax cannot leak through.
            any_visible = ~hidden.all(dim=-1, keepdim=True)  # (B|1, 1, T|1, 1)
            z = torch.where(any_visible, z, torch.zeros((), dtype=z.dtype))
        z = z.transpose(1, 2).reshape(B, T, c.v_dim)  # (B, T, N*vhd), heads concatenated
        y = self.out_proj(z)
        if c.kv_cache:
            return y, present_k, present_v
        return y

    def _hidden_keys(
        self, x: torch.Tensor, T: int, S: int, key_padding_mask: torch.Tensor | None, past: int = 0
    ) -> torch.Tensor | None:
        """True where key j is hidden from query i, broadcastable to (B, N, T, S). With a cache,
        query i sits at position past + i and key j at position j: the mask is over positions."""
        c = self.config
        hidden = None
        if c.causal and c.kv_cache:
            i = torch.arange(T, device=x.device) + past  # query positions
            j = torch.arange(S, device=x.device)  # key positions (S = past + T)
            hidden = (j[None, :] > i[:, None])[None, None]  # (1, 1, T, S): key j after query i
        elif c.causal:
            i = torch.arange(T, device=x.device)
            hidden = (i[None, :] > i[:, None])[None, None]  # (1, 1, T, S=T): key j > query i
        if c.key_padding_mask:
            if key_padding_mask is None:
                raise UsageError("this model takes a key_padding_mask input")
            kpm = key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, S)
            hidden = kpm if hidden is None else hidden | kpm
        return hidden

    def _decomposed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None
    ) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.config.softmax_scale  # (B, N, T, S)
        if hidden is not None:
            # The dtype's lowest finite value, not -inf: exp(lowest - max) is exactly 0 for a
            # hidden key, and a fully hidden row stays finite (fp16 included).
            scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        p = torch.softmax(scores, dim=-1)
        return torch.matmul(p, v)  # (B, N, T, vhd)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        scale = self.config.softmax_scale
        if hidden is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        if self.config.causal and not self.config.key_padding_mask and not self.config.kv_cache:
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
