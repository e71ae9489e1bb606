"""The checkpoints attnx imports, as tables: where each architecture keeps its attention's tensors and how its
config.json names the widths, heads, masks and scale (ARCHITECTURES, Layout); the rotary decoders (ROTARY_FAMILIES,
RotaryFamily) and the ALiBi decoders (ALIBI_FAMILIES, AlibiFamily) with their config classes' defaults; what attnx's
formula does not include, refused by name (NOT_EXPRESSIBLE); and what an import gives (ImportResult)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.model.config import AttentionConfig

__all__ = ["ALIBI_FAMILIES", "ARCHITECTURES", "AlibiFamily", "CHUNKED", "FULL", "ImportResult", "KNOWN_ARCHITECTURES", "Layout",
           "NOT_EXPRESSIBLE", "READ_AS", "ROTARY_FAMILIES", "RotaryFamily", "SLIDING"]

@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one attention block of an architecture keeps its projections ({N}: the layer)."""

    q: str  # tensor name prefix (".weight"/".bias" appended); for "conv1d-packed": the packed q|k|v
    k: str | None
    v: str | None
    o: str
    heads: str  # config.json key of the number of heads
    width: str = "hidden_size"  # config.json key of d_model
    head_dim: str | None = None  # config.json key of the head width, when it is not width / heads
    storage: str = "linear"  # "linear": torch Linear [out, in]; "conv1d-packed": GPT-2's Conv1D [in, 3*out]
    bias: str = "all"  # "all", "none", or "no-k" (Whisper's k_proj has none)
    causal: bool = False
    cross: bool = False
    key_padding_mask: bool = True  # the default: does this attention take a padding mask
    unit_scale: bool = False  # T5: scores are q.k, no 1/sqrt(head_dim)
    refuse: str | None = None  # why attnx cannot reproduce this block

    def names(self, layer: int) -> dict[str, str]:
        out = {"q": self.q, "k": self.k, "v": self.v, "o": self.o}
        return {k: v.format(N=layer) for k, v in out.items() if v is not None}


def _bert(prefix: str, self_name: str, heads: str = "num_attention_heads") -> Layout:
    return Layout(f"{prefix}.{self_name}.query", f"{prefix}.{self_name}.key", f"{prefix}.{self_name}.value",
                  f"{prefix}.output.dense", heads)  # fmt: skip


def _bart(block: str, heads: str, bias: str = "all", **kw: Any) -> Layout:
    return Layout(f"{block}.q_proj", f"{block}.k_proj", f"{block}.v_proj", f"{block}.out_proj", heads, "d_model",
                  bias=bias, **kw)  # fmt: skip


_T5_SELF = ("T5's self-attention adds a learned relative position bias to every score, which attnx's formula "
            "does not include: it cannot be reproduced (its cross-attention can: --attention cross)")  # fmt: skip


_T5 = dict(heads="num_heads", width="d_model", head_dim="d_kv", bias="none", unit_scale=True)


ARCHITECTURES: dict[str, dict[tuple[str, str], Layout]] = {
    "bert": {("encoder", "self"): _bert("encoder.layer.{N}.attention", "self")},
    "roberta": {("encoder", "self"): _bert("encoder.layer.{N}.attention", "self")},
    "vit": {("encoder", "self"): dataclasses.replace(_bert("encoder.layer.{N}.attention", "attention"),
                                                      key_padding_mask=False)},  # fmt: skip
    "gpt2": {("decoder", "self"): Layout("h.{N}.attn.c_attn", None, None, "h.{N}.attn.c_proj", "n_head", "n_embd",
                                         storage="conv1d-packed", causal=True)},  # fmt: skip
    "bart": {
        ("encoder", "self"): _bart("encoder.layers.{N}.self_attn", "encoder_attention_heads"),
        ("decoder", "self"): _bart("decoder.layers.{N}.self_attn", "decoder_attention_heads", causal=True),
        ("decoder", "cross"): _bart("decoder.layers.{N}.encoder_attn", "decoder_attention_heads", cross=True),
    },
    "whisper": {
        ("encoder", "self"): _bart("encoder.layers.{N}.self_attn", "encoder_attention_heads", "no-k",
                                   key_padding_mask=False),  # fmt: skip
        ("decoder", "self"): _bart("decoder.layers.{N}.self_attn", "decoder_attention_heads", "no-k", causal=True),
        ("decoder", "cross"): _bart("decoder.layers.{N}.encoder_attn", "decoder_attention_heads", "no-k", cross=True),
    },
    "t5": {
        ("encoder", "self"): Layout("encoder.block.{N}.layer.0.SelfAttention.q", "encoder.block.{N}.layer.0.SelfAttention.k",
                                    "encoder.block.{N}.layer.0.SelfAttention.v", "encoder.block.{N}.layer.0.SelfAttention.o",
                                    refuse=_T5_SELF, **_T5),
        ("decoder", "self"): Layout("decoder.block.{N}.layer.0.SelfAttention.q", "decoder.block.{N}.layer.0.SelfAttention.k",
                                    "decoder.block.{N}.layer.0.SelfAttention.v", "decoder.block.{N}.layer.0.SelfAttention.o",
                                    causal=True, refuse=_T5_SELF, **_T5),
        ("decoder", "cross"): Layout("decoder.block.{N}.layer.1.EncDecAttention.q", "decoder.block.{N}.layer.1.EncDecAttention.k",
                                     "decoder.block.{N}.layer.1.EncDecAttention.v", "decoder.block.{N}.layer.1.EncDecAttention.o",
                                     cross=True, **_T5),
    },
}  # fmt: skip


# transformers 5.24's Falcon (models/falcon/modeling_falcon.py; measured: measurements/alibi_transformers)
_FALCON_ALIBI = ("transformers' Falcon adds its ALiBi bias before the scale (slope / sqrt(head_dim) per unit of "
                 "distance, not the slopes of BLOOM and MPT) and rounds the slopes and each slope * position to "
                 "bfloat16 (build_alibi_tensor: 1.1 off in the scores at position 2047 of Falcon-RW-1B's 32 "
                 "heads), which attnx's alibi (float slopes, after the scale) does not include; its eager "
                 "attention also adds the bias twice, its sdpa attention and Falcon-RW's own code once")


# Architectures whose layers attnx cannot import, and why (checked before anything is read).
NOT_EXPRESSIBLE = {
    # models/deepseek_v32: DeepSeek Sparse Attention, MLA over the keys a lightning indexer picks per query
    "deepseek_v32": ("each query attends only to the index_topk keys its lightning indexer scores highest (DeepSeek "
                     "Sparse Attention), a selection attnx's formula does not include"),
    # models/longcat_flash: LongcatFlashMLA scales q and the compressed kv by sqrt(hidden / rank), two attentions a layer
    "longcat_flash": ("its MLA scales q by sqrt(hidden_size / q_lora_rank) and the compressed kv by sqrt(hidden_size / "
                      "kv_lora_rank), and each layer holds two attentions, which attnx's latent term does not read"),
}  # fmt: skip


@dataclasses.dataclass
class ImportResult:
    """What an import produced, and how."""

    config: AttentionConfig
    weights: dict[str, np.ndarray]
    source: str  # what was read: a folder and its model_type, or a module
    mapping: list[str]  # one line per attnx tensor: where it came from and how
    notes: list[str]
    architecture: str | None = None  # model_type, for a checkpoint
    layer: int | None = None
    stack: str | None = None
    attention: str | None = None

    def lines(self) -> list[str]:
        return [f"imported {self.source}", *(f"  {m}" for m in self.mapping), *(f"note: {n}" for n in self.notes)]


# Rotary decoders ----------------------------------------------------------------------------------
# The modern-LLM families (docs/concepts/formula.md, "Modern LLM attention"): their attention is attnx's formula with
# the config keys rope, sliding_window, softcap, qk_norm and sinks. Their config.json is read as
# transformers (5.24) reads it: each family's config class fills in defaults for the keys a
# checkpoint omits, and the rope keys come in two spellings, the older rope_theta + rope_scaling and
# the newer rope_parameters (nested by layer type for Gemma 3). Every default is resolved here and
# written as a number.
FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


_LAYER_TYPE_NAMES = {"attention": FULL}  # transformers' remap of legacy layer type names


@dataclasses.dataclass(frozen=True)
class RotaryFamily:
    """One rotary decoder family: where its attention keeps its tensors (model.layers.{N}.self_attn)
    and how transformers reads its config (the class defaults of the keys read included)."""

    defaults: Mapping[str, Any]  # the config class's defaults of every key the import reads
    bias: str = "config"  # "config": attention_bias on all four projections; "qkv": q/k/v (Qwen2); "none"
    fused_qkv: bool = False  # one qkv_proj, rows q | k | v (Phi-3)
    qk_norm: str | None = None  # "w": RMSNorm weights as stored (Qwen3); "1+w": Gemma's (1 + w), folded
    sinks: bool = False  # a learned sink logit per head (gpt-oss)
    windows: str = "none"  # "all": sliding_window on every layer; "layer_types": the layer's type decides
    pattern: str = "alternating"  # layer_types when the config gives none: "alternating", "qwen", "gemma3", "llama4"
    scale_key: str | None = None  # the config key whose ^-1/2 is the scale (Gemma); None: head_dim^-1/2
    softcap_key: str | None = None  # the config key of the scores' softcap (Gemma)
    rope_reader: str = "standard"  # transformers' convert_rope_params_to_dict: "standard", "gemma3", "phi3"
    partial_rotary: bool = False  # whether its attention rotates only the first dims (Phi-3 slices q and k)
    interleaved: bool = False  # pairs (2i, 2i + 1): Llama 4's rotation as a complex product of adjacent dims
    # Llama 4: the config key listing, per layer, 1 where it rotates and 0 where it has no position (NoPE), and its
    # class's default interval (every n-th layer NoPE); on rotating layers a weightless q/k norm after the rotation
    # when `l2_norm_key` is true, on NoPE layers the attention temperature (attn_temperature_tuning)
    rope_layers: str | None = None
    l2_norm_key: str | None = None
    temperature: bool = False
    # multi-head latent attention (the config's `latent`: DeepSeek-V2/V3): its projections, the latent's ranks and
    # head sizes read from qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank and kv_lora_rank; the key
    # saying whether its rope pairs are interleaved (None: `interleaved`)
    latent: bool = False
    interleave_key: str | None = None

    def names(self, layer: int) -> dict[str, str]:
        base = f"layers.{layer}.self_attn"
        if self.latent:
            return {**{p: f"{base}.{p}" for p in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj",
                                                  "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")},
                    "o": f"{base}.o_proj", "base": base}  # fmt: skip
        if self.fused_qkv:
            return {"qkv": f"{base}.qkv_proj", "o": f"{base}.o_proj", "base": base}
        return {"q": f"{base}.q_proj", "k": f"{base}.k_proj", "v": f"{base}.v_proj", "o": f"{base}.o_proj",
                "base": base}  # fmt: skip


_COMMON = {"num_key_value_heads": None, "head_dim": None, "attention_bias": False, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "sliding_window": None}  # fmt: skip


# transformers 5.24's config classes: models/<family>/configuration_<family>.py.
ROTARY_FAMILIES: dict[str, RotaryFamily] = {
    "llama": RotaryFamily({**_COMMON, "hidden_size": 4096, "num_attention_heads": 32,
                           "max_position_embeddings": 2048}),
    "mistral": RotaryFamily({**_COMMON, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
                             "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
                            bias="none", windows="all"),
    "qwen2": RotaryFamily({**_COMMON, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
                           "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
                           "max_window_layers": 28}, bias="qkv", windows="layer_types", pattern="qwen"),
    "qwen3": RotaryFamily({**_COMMON, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
                           "head_dim": 128, "max_position_embeddings": 32768, "use_sliding_window": False,
                           "sliding_window": 4096, "max_window_layers": 28},
                          qk_norm="w", windows="layer_types", pattern="qwen"),
    "gemma2": RotaryFamily({**_COMMON, "hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4,
                            "head_dim": 256, "max_position_embeddings": 8192, "query_pre_attn_scalar": 256,
                            "sliding_window": 4096, "attn_logit_softcapping": 50.0},
                           windows="layer_types", scale_key="query_pre_attn_scalar",
                           softcap_key="attn_logit_softcapping"),
    "gemma3_text": RotaryFamily({**_COMMON, "hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4,
                                 "head_dim": 256, "max_position_embeddings": 131072, "query_pre_attn_scalar": 256,
                                 "sliding_window": 4096, "attn_logit_softcapping": None, "sliding_window_pattern": 6,
                                 "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                                 "use_bidirectional_attention": False},
                                qk_norm="1+w", windows="layer_types", pattern="gemma3",
                                scale_key="query_pre_attn_scalar", softcap_key="attn_logit_softcapping",
                                rope_reader="gemma3"),
    "phi3": RotaryFamily({**_COMMON, "hidden_size": 3072, "num_attention_heads": 32, "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 4096, "original_max_position_embeddings": 4096},
                         bias="none", fused_qkv=True, windows="all", rope_reader="phi3", partial_rotary=True),
    # models/llama4: Llama4TextConfig (the text model of a Llama 4 checkpoint, model_type llama4_text)
    "llama4_text": RotaryFamily({**_COMMON, "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8,
                                 "head_dim": 128, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                                 "rope_theta": 500000.0, "use_qk_norm": True, "no_rope_layers": None,
                                 "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
                                 "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1},
                                windows="layer_types", pattern="llama4", interleaved=True,
                                rope_layers="no_rope_layers", l2_norm_key="use_qk_norm", temperature=True),
    "gpt_oss": RotaryFamily({**_COMMON, "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
                             "head_dim": 64, "max_position_embeddings": 131072, "attention_bias": True,
                             "sliding_window": 128, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
                             "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 4096}},
                            sinks=True, windows="layer_types"),
    # models/deepseek_v3, models/deepseek_v2: DeepseekV3Attention, DeepseekV2Attention (MLA; the latents' RMSNorms
    # at their class default eps 1e-6, not rms_norm_eps; V2 rotates adjacent pairs as complex numbers)
    "deepseek_v3": RotaryFamily({**_COMMON, "hidden_size": 7168, "num_attention_heads": 128,
                                 "num_key_value_heads": 128, "max_position_embeddings": 4096, "kv_lora_rank": 512,
                                 "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
                                 "qk_nope_head_dim": 128, "rope_interleave": True},
                                latent=True, interleave_key="rope_interleave"),
    "deepseek_v2": RotaryFamily({**_COMMON, "hidden_size": 4096, "num_attention_heads": 32,
                                 "max_position_embeddings": 2048, "kv_lora_rank": 512, "q_lora_rank": 1536,
                                 "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128},
                                latent=True, interleaved=True),
    # models/glm4_moe_lite (GLM-4.7-Flash): Glm4MoeLiteAttention is DeepseekV3Attention (its modular file derives it),
    # under its own config defaults
    "glm4_moe_lite": RotaryFamily({**_COMMON, "hidden_size": 2048, "num_attention_heads": 20,
                                   "num_key_value_heads": 20, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
                                   "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64, "v_head_dim": 256,
                                   "qk_nope_head_dim": 192, "rope_interleave": True},
                                  latent=True, interleave_key="rope_interleave"),
    # models/minicpm3: MiniCPM3Attention, DeepSeek-V2's MLA with half-split rope pairs; v_head_dim null is
    # hidden_size / heads (its config's rule)
    "minicpm3": RotaryFamily({**_COMMON, "hidden_size": 2560, "num_attention_heads": 40, "num_key_value_heads": 40,
                              "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "kv_lora_rank": 256,
                              "q_lora_rank": 768, "qk_rope_head_dim": 32, "v_head_dim": None,
                              "qk_nope_head_dim": 64}, latent=True),
}  # fmt: skip
# model_types of a checkpoint's own code (trust_remote_code) whose attention is a family's of transformers: read with
# that family's row and, for --check, that family's transformers class, never the checkpoint's code. Kimi K2 names
# DeepseekV3ForCausalLM with model_type kimi_k2, and transformers 5.24 itself reads a kimi_k2 text config as
# deepseek_v3 (Kimi K2.5's config class)
READ_AS = {"kimi_k2": "deepseek_v3"}
ROTARY_FAMILIES.update({alias: ROTARY_FAMILIES[family] for alias, family in READ_AS.items()})
_LATENT_EPS = 1e-6  # DeepseekV3RMSNorm's and DeepseekV2RMSNorm's default, which q_a_layernorm and kv_a_layernorm keep


# Every model_type `attnx import` reads.
# ALiBi decoders -------------------------------------------------------------------------------------
# BLOOM and MPT: causal self-attention with the `alibi` key (attnx.model.alibi; measurements/alibi_transformers), one fused
# q/k/v projection split here. Their config.json is read as transformers (5.24) reads it: the config
# class's default for a key the checkpoint omits, the older key names it still takes.
@dataclasses.dataclass(frozen=True)
class AlibiFamily:
    """One ALiBi decoder family: its config keys (the first one a checkpoint gives wins, else the class
    default), where its attention keeps its tensors ({N}: the layer) and how q, k, v share the fused rows."""

    width: tuple[str, ...]  # config.json keys of d_model
    heads: tuple[str, ...]
    layers: tuple[str, ...]
    defaults: Mapping[str, Any]  # the config class's defaults of the keys above
    qkv: str  # the fused projection
    out: str
    rows: str  # "per-head": rows [n_heads, 3, head_dim] (BLOOM); "q|k|v": three blocks (MPT)
    bias: bool  # biases on the fused projection and the output's


ALIBI_FAMILIES: dict[str, AlibiFamily] = {
    # models/bloom: BloomConfig (n_embed is its older name of hidden_size, and wins), BloomAttention._reshape
    "bloom": AlibiFamily(("n_embed", "hidden_size"), ("n_head", "num_attention_heads"), ("n_layer", "num_hidden_layers"),
                         {"hidden_size": 64, "n_head": 8, "n_layer": 2}, "h.{N}.self_attention.query_key_value",
                         "h.{N}.self_attention.dense", "per-head", bias=True),
    # models/mpt: MptConfig, MptAttention (Wqkv and out_proj without bias, q|k|v chunks)
    "mpt": AlibiFamily(("d_model", "hidden_size"), ("n_heads", "num_attention_heads"), ("n_layers", "num_hidden_layers"),
                       {"d_model": 2048, "n_heads": 16, "n_layers": 24}, "blocks.{N}.attn.Wqkv",
                       "blocks.{N}.attn.out_proj", "q|k|v", bias=False),
}  # fmt: skip


# MptAttentionConfig's defaults, and why a value other than the one attnx takes is refused: what transformers'
# MptAttention ignores but MPT's own code (trust_remote_code) computes, the two disagree on.
_MPT_ATTN_DEFAULTS = {"attn_type": "multihead_attention", "clip_qkv": None, "softmax_scale": None, "prefix_lm": False,
                      "qk_ln": False, "alibi": True, "alibi_bias_max": 8}  # fmt: skip


_MPT_REFUSED = {
    "qk_ln": "a LayerNorm of q and k (MPT's own code) that transformers' MptAttention does not apply and attnx's "
             "formula does not include",
    "clip_qkv": "q, k and v clamped to +-clip_qkv after the fused projection, which attnx's formula does not include",
    "alibi": "MPT's own code then adds learned position embeddings and no bias, while transformers' MptModel "
             "adds ALiBi whatever the key says: the two disagree",
    "alibi_bias_max": "MPT's own code takes it, while transformers' MptModel always builds its slopes with 8 "
                      "(build_mpt_alibi_tensor's default: forward passes no alibi_bias_max): the two disagree, "
                      "and attnx's slopes are those of 8",
    "attn_type": "multi-query attention, which transformers' MptAttention does not build (its Wqkv is 3 * d_model "
                 "rows)",
    "prefix_lm": "bidirectional attention over a prefix (a prefix_mask input), which attnx's causal formula does "
                 "not include",
}  # fmt: skip


KNOWN_ARCHITECTURES = (*ARCHITECTURES, *ROTARY_FAMILIES, *ALIBI_FAMILIES)
