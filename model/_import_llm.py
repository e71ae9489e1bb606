"""The import of one attention layer of a rotary decoder (import_rotary: rope with every scaling, windows, softcap,
q/k norms, sinks, grouped heads) or an ALiBi decoder (import_alibi), their config.json read as transformers 5.24
reads it (the family's class defaults; both spellings of the rope keys), every default resolved to a number."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx.errors import UsageError, WeightsError
from attnx.model.checkpoint import Checkpoint
from attnx.model.config import AttentionConfig
from attnx.model.families import (
    _LATENT_EPS,
    _LAYER_TYPE_NAMES,
    _MPT_ATTN_DEFAULTS,
    _MPT_REFUSED,
    ALIBI_FAMILIES,
    CHUNKED,
    FULL,
    ROTARY_FAMILIES,
    SLIDING,
    ImportResult,
    RotaryFamily,
)
from attnx.model.rope import REFUSED_ROPE_TYPES
from attnx.model.weights import check_finite, check_weights

__all__ = ["import_alibi", "import_rotary", "rotary_widths"]

def import_alibi(folder: str, hf: Mapping[str, Any], model_type: str, layer: int,
                  key_padding_mask: bool | None) -> ImportResult:  # fmt: skip
    """One self-attention layer of an ALiBi decoder (ALIBI_FAMILIES)."""
    family = ALIBI_FAMILIES[model_type]

    def number(keys: tuple[str, ...]) -> int:
        given = [k for k in keys if hf.get(k) is not None]
        key = given[0] if given else next(k for k in keys if k in family.defaults)
        value = hf[key] if given else family.defaults[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{folder!r} config.json: {key!r} must be a positive integer, got {value!r}")
        return value

    d_model, n_heads, n_layers = number(family.width), number(family.heads), number(family.layers)
    if d_model % n_heads:
        raise UsageError(f"{model_type}: hidden size {d_model} is not divisible by {n_heads} heads "
                         "(transformers refuses it)")  # fmt: skip
    head_dim = d_model // n_heads
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise UsageError(f"--layer must be a non-negative integer, got {layer!r}")
    if layer >= n_layers:
        raise UsageError(f"{model_type} has {n_layers} layers: no layer {layer}")
    notes = [f"alibi: the slopes of {n_heads} heads (attnx.model.alibi: the paper's, bias max 8), slope * (j - i) "
             "over token index after the scale"]  # fmt: skip
    scale = None
    if model_type == "mpt":
        attn = {**_MPT_ATTN_DEFAULTS, **(hf.get("attn_config") or {})}
        for key, why in _MPT_REFUSED.items():
            if attn.get(key) != _MPT_ATTN_DEFAULTS[key]:
                raise UsageError(f"mpt with attn_config {key} {attn[key]!r}: {why}: not imported")
        if hf.get("no_bias", True) is not True:
            raise UsageError("mpt with no_bias false: MPT's own code adds biases, transformers' MptAttention has "
                             "none (its Wqkv and out_proj are built without): the two disagree: not imported")  # fmt: skip
        if attn["softmax_scale"] is not None:
            scale = float(attn["softmax_scale"])
            notes.append(f"scale: attn_config softmax_scale {scale!r}")
        max_len = hf.get("max_seq_len", 2048)
        notes.append(f"transformers' MPT builds its bias for max_seq_len ({max_len}) keys and fails past them; "
                     "attnx's term has no length limit")  # fmt: skip
    ckpt = Checkpoint(folder)
    qkv_name, out_name = family.qkv.format(N=layer), family.out.format(N=layer)
    if ckpt.find(out_name + ".weight") is None:
        raise UsageError(f"{model_type} has no layer {layer} ({out_name}.weight is not in the checkpoint)")
    weights: dict[str, np.ndarray] = {}
    mapping: list[str] = []
    names = ("q_proj", "k_proj", "v_proj")
    fused = {"weight": ckpt.get(qkv_name + ".weight")}  # [3 * d_model, d_model]
    if family.bias:
        fused["bias"] = ckpt.get(qkv_name + ".bias")
    for kind, (key, tensor) in fused.items():
        if tensor.shape[0] != 3 * d_model:
            raise WeightsError(f"{key} has {tensor.shape[0]} rows, expected 3 * {d_model} (q, k, v)")
        if family.rows == "per-head":  # BLOOM: row h * 3 * head_dim + t * head_dim + d, t = q, k, v
            parts = tensor.reshape(n_heads, 3, head_dim, *tensor.shape[1:])  # (N, 3, hd[, d_model])
            for t, ours in enumerate(names):
                weights[f"{ours}.{kind}"] = np.ascontiguousarray(parts[:, t]).reshape(d_model, *tensor.shape[1:])
                mapping.append(f"{ours}.{kind} <- {key} (rows [n_heads, 3, head_dim]: each head's part {t + 1}/3)")
        else:  # MPT: three blocks of d_model rows, q | k | v
            for t, ours in enumerate(names):
                weights[f"{ours}.{kind}"] = tensor[t * d_model : (t + 1) * d_model]
                mapping.append(f"{ours}.{kind} <- {key}[{t * d_model}:{(t + 1) * d_model}] (rows of the fused q|k|v)")
    key, weights["out_proj.weight"] = ckpt.get(out_name + ".weight")
    mapping.append(f"out_proj.weight <- {key}")
    if family.bias:
        key, weights["out_proj.bias"] = ckpt.get(out_name + ".bias")
        mapping.append(f"out_proj.bias <- {key}")
    try:
        config = AttentionConfig(d_model=d_model, n_heads=n_heads, bias=family.bias, causal=True,
                                 key_padding_mask=True if key_padding_mask is None else key_padding_mask,
                                 scale=scale, alibi=True)  # fmt: skip
    except UsageError as e:
        raise WeightsError(f"{folder!r}: layer {layer} does not fit attnx's config: {e}") from None
    check_weights(config, weights, f"{folder!r} layer {layer}")
    check_finite(weights, f"{folder!r} layer {layer}")
    if ckpt.converted:
        notes.append(f"tensors stored as {', '.join(sorted(ckpt.converted))} converted to float32")
    notes.append("imported: the attention block only (its projections); the layer norms, residuals and MLP "
                 "around it are not part of attnx's formula")  # fmt: skip
    return ImportResult(config, weights, f"{folder} ({model_type}, decoder self-attention, layer {layer})",
                        mapping, notes, model_type, layer, "decoder", "self")  # fmt: skip


def _layer_types(hf: Mapping[str, Any], family: RotaryFamily, n_layers: int) -> list[str]:
    """config.layer_types, or the pattern the family's config class fills in when it has none."""
    given = hf.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or not all(isinstance(t, str) for t in given):
            raise UsageError(f"config.json 'layer_types' must be a list of names, got {given!r}")
        return [_LAYER_TYPE_NAMES.get(t, t) for t in given]
    if family.pattern == "llama4":  # Llama4TextConfig: the rotating layers chunked, when it has a chunk size
        return [CHUNKED if rotates and hf.get("attention_chunk_size") is not None else FULL
                for rotates in _rope_layers(hf, family, n_layers)]  # fmt: skip
    if family.pattern == "qwen":
        window = hf["sliding_window"] if hf.get("use_sliding_window") else None
        return [SLIDING if window is not None and i >= hf["max_window_layers"] else FULL for i in range(n_layers)]
    period = hf["sliding_window_pattern"] if family.pattern == "gemma3" else 2
    return [SLIDING if (i + 1) % period else FULL for i in range(n_layers)]


def _rope_layers(hf: Mapping[str, Any], family: RotaryFamily, n_layers: int) -> list[bool]:
    """Whether each layer rotates: every one, or as the family's rope_layers key says (Llama 4's no_rope_layers,
    1 where the layer rotates; empty or absent: Llama4TextConfig's default, every interval-th layer without)."""
    if family.rope_layers is None:
        return [True] * n_layers
    given = hf.get(family.rope_layers)
    if not given:
        interval = hf["no_rope_layer_interval"]
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise UsageError(f"config.json 'no_rope_layer_interval' must be a positive integer, got {interval!r}")
        return [(i + 1) % interval != 0 for i in range(n_layers)]
    if not isinstance(given, list) or any(v not in (0, 1) or isinstance(v, float) for v in given) or \
            len(given) < n_layers:  # fmt: skip
        raise UsageError(f"config.json {family.rope_layers!r} must list 0 or 1 for each of the {n_layers} layers, "
                         f"got {given!r}")  # fmt: skip
    return [bool(v) for v in given[:n_layers]]


def _hf_rope_parameters(hf: Mapping[str, Any], family: RotaryFamily, layer_type: str) -> dict[str, Any]:
    """The rope parameters transformers computes the layer's frequencies from, as its
    convert_rope_params_to_dict and standardize_rope_params leave them: rope_type, rope_theta,
    partial_rotary_factor, original_max_position_embeddings and the scaling's own keys."""
    scaling = hf.get("rope_scaling")  # the older spelling, beside rope_theta
    if family.rope_reader == "gemma3":
        given = hf.get("rope_parameters")
        params = copy.deepcopy(given) if given is not None else {SLIDING: {"rope_type": "default"},
                                                                  FULL: {"rope_type": "default"}}  # fmt: skip
        if not isinstance(params, dict):
            raise UsageError(f"config.json 'rope_parameters' must be an object, got {given!r}")
        if scaling is not None:  # the older checkpoints' rope_scaling applies to the global (full) layers
            params.setdefault(FULL, {"rope_type": "default"}).update(scaling)
        params[FULL] = params.get(FULL) or {"rope_type": "default"}
        params[FULL].setdefault("rope_theta", hf["rope_theta"])
        params[SLIDING] = params.get(SLIDING) or {"rope_type": "default"}
        params[SLIDING].setdefault("rope_theta", hf["rope_local_base_freq"])  # the local layers' own theta
        nested = True
    else:
        params = copy.deepcopy(scaling or hf.get("rope_parameters") or family.defaults.get("rope_parameters") or {})
        if not isinstance(params, dict):
            raise UsageError(f"config.json 'rope_parameters' must be an object, got {params!r}")
        nested = any(key in (FULL, SLIDING) for key in params)
        if family.rope_reader == "phi3":
            params.setdefault("rope_theta", hf["rope_theta"])
            params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if nested:
        layer_params = params.get(layer_type)
        if not isinstance(layer_params, dict):
            raise UsageError(f"config.json 'rope_parameters' gives no parameters for the layer type {layer_type!r}")
        params = layer_params
    params.setdefault("rope_theta", hf["rope_theta"])
    if hf.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    params.pop("type", None)
    if family.rope_reader == "phi3" and params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"  # Phi-3's older names of its longrope
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        if not nested and "original_max_position_embeddings" in hf:
            # transformers gives a top-level original_max_position_embeddings priority over the rope
            # dict's (Phi-3 saves it there; its config class defaults it to 4096)
            params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", hf["max_position_embeddings"])
    return params


# The keys of transformers' rope parameters each attnx scaling takes (docs/concepts/formula.md, "Modern LLM attention").
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate", "attention_factor",
             "mscale", "mscale_all_dim"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"),
}  # fmt: skip


def _rope_config(hf: Mapping[str, Any], family: RotaryFamily, model_type: str, layer_type: str,
                 head_dim: int) -> tuple[dict[str, Any], str]:  # fmt: skip
    """The config's `rope` for the layer, every default resolved, and a note of where it came from."""
    params = _hf_rope_parameters(hf, family, layer_type)
    kind = params["rope_type"]
    if kind in REFUSED_ROPE_TYPES:
        raise UsageError(f"{model_type} with rope_type {kind!r}: {REFUSED_ROPE_TYPES[kind]}: not imported")
    if kind != "default" and kind not in _ROPE_KEYS:
        raise UsageError(f"{model_type} with rope_type {kind!r}: a rotary scaling attnx's formula does not include "
                         f"(it has: default, {', '.join(_ROPE_KEYS)}): not imported")  # fmt: skip
    if family.rope_reader == "phi3" and kind not in ("default", "longrope"):
        raise UsageError(f"phi3 with rope_type {kind!r}: transformers' Phi-3 takes only default and longrope")
    factor = params.get("partial_rotary_factor", 1.0)
    # Each family's default rope rotates every dim whatever the factor, but Phi-3's; the scaled
    # types (transformers' ROPE_INIT_FUNCTIONS) read it everywhere.
    dim = int(head_dim * factor) if family.partial_rotary or kind != "default" else head_dim
    if dim != head_dim and not family.partial_rotary:
        raise UsageError(f"{model_type} with partial_rotary_factor {factor}: its attention rotates every dim of a "
                         "head (transformers' apply_rotary_pos_emb), so the factor has no layer to import")  # fmt: skip
    scaling = None
    if kind != "default":
        scaling = {"rope_type": kind}
        for key in _ROPE_KEYS[kind]:
            if params.get(key) is not None:
                scaling[key] = params[key]
        if kind in ("yarn", "longrope") and scaling.get("factor") is None:
            # transformers' default: the ratio of the two lengths
            scaling["factor"] = hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
        if kind == "yarn":
            # transformers reads `beta_fast or 32`, `beta_slow or 1`; truncate from the top-level dict
            scaling["beta_fast"] = params.get("beta_fast") or 32.0
            scaling["beta_slow"] = params.get("beta_slow") or 1.0
            scaling["truncate"] = params.get("truncate", True)
    rope = {"theta": params["rope_theta"], "dim": dim, "interleaved": family.interleaved, "scaling": scaling}
    return rope, f"rope: rope_type {kind}, theta {params['rope_theta']}, {dim} of {head_dim} dims rotated"


def _latent_weights(ckpt: Checkpoint, names: Mapping[str, str], latent: Mapping[str, Any],
                    bias: bool) -> tuple[dict[str, np.ndarray], list[str], tuple[str, ...]]:  # fmt: skip
    """An MLA layer's tensors under transformers' names (attnx.model.terms.Latent), the mapping, and the projections
    with a bias (attention_bias: q_a_proj, kv_a_proj_with_mqa, o_proj; q_proj has none in transformers: zeros)."""
    weights: dict[str, np.ndarray] = {}
    mapping: list[str] = []
    q = ("q_proj",) if latent["q_lora_rank"] is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    for part in (*q, "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"):
        key, weights[f"{part}.weight"] = ckpt.get(names[part] + ".weight")
        mapping.append(f"{part}.weight <- {key}")
    if not bias:
        return weights, mapping, ()
    for part in (q[0], "kv_a_proj_with_mqa"):
        if part == "q_proj":  # a projection without bias is one with a zero bias: exact
            weights["q_proj.bias"] = np.zeros(weights["q_proj.weight"].shape[0], np.float32)
            mapping.append("q_proj.bias <- zeros (the source's q_proj has no bias)")
        else:
            key, weights[f"{part}.bias"] = ckpt.get(names[part] + ".bias")
            mapping.append(f"{part}.bias <- {key}")
    return weights, mapping, ("o",)


def _latent_scale(hf: Mapping[str, Any], family: RotaryFamily, layer_type: str,
                  head_dim: int) -> tuple[float | None, str | None]:  # fmt: skip
    """transformers' DeepseekV3Attention.scaling: head_dim^-1/2 times mscale^2, mscale = 0.1 mscale_all_dim
    ln(factor) + 1 (1 for factor <= 1), when the rope is scaled and its mscale_all_dim is set (yarn_apply_mscale);
    None (the default scale) otherwise."""
    params = _hf_rope_parameters(hf, family, layer_type)
    m_all = params.get("mscale_all_dim") or 0
    if params["rope_type"] == "default" or not m_all:
        return None, None
    factor = params["factor"]
    mscale = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
    scale = head_dim**-0.5 * mscale * mscale
    return scale, f"scale head_dim^-1/2 * mscale^2 = {head_dim}^-1/2 * {mscale!r}^2 = {scale!r} (mscale_all_dim {m_all})"


def rotary_widths(folder: str, hf: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(d_model, n_heads, n_kv_heads, head_dim) of a rotary decoder's config (its family's defaults merged in)."""

    def number(key: str, value: Any = None) -> int:
        value = hf.get(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{folder!r} config.json: {key!r} must be a positive integer, got {value!r}")
        return value

    d_model, n_heads = number("hidden_size"), number("num_attention_heads")
    n_kv_heads = number("num_key_value_heads", hf["num_key_value_heads"] or n_heads)
    return d_model, n_heads, n_kv_heads, number("head_dim", hf["head_dim"] or d_model // n_heads)


def import_rotary(folder: str, hf: Mapping[str, Any], model_type: str, layer: int,
                   key_padding_mask: bool | None) -> ImportResult:  # fmt: skip
    """One self-attention layer of a rotary decoder (ROTARY_FAMILIES)."""
    family = ROTARY_FAMILIES[model_type]
    hf = {**family.defaults, **hf}  # a key the checkpoint gives, null included, overrides the class default
    if model_type == "gemma3_text" and hf.get("use_bidirectional_attention"):
        raise UsageError("gemma3_text with use_bidirectional_attention: its attention is not causal (every token "
                         "sees a window on both sides), which attnx's decoder formula does not include: not imported")  # fmt: skip

    def number(key: str, value: Any = None) -> int:
        value = hf.get(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{folder!r} config.json: {key!r} must be a positive integer, got {value!r}")
        return value

    v_head_dim = latent = None
    if family.latent:  # MLA: a head is [nope | rope] for q and k, v_head_dim apart; k and v for every head
        d_model, n_heads = number("hidden_size"), number("num_attention_heads")
        n_kv_heads, rope_dim = n_heads, number("qk_rope_head_dim")
        head_dim = number("qk_nope_head_dim") + rope_dim
        # null: hidden_size / heads (MiniCPM3Config's rule; DeepSeek's classes default it to 128)
        v_head_dim = number("v_head_dim") if hf["v_head_dim"] is not None else number("v_head_dim", d_model // n_heads)
        if hf["num_key_value_heads"] not in (None, n_heads):
            raise UsageError(f"{model_type} with num_key_value_heads {hf['num_key_value_heads']} for "
                             f"{n_heads} heads: its latent expands k and v for every head, and transformers' eager "
                             "attention would repeat those heads again: not imported")  # fmt: skip
        q_lora = hf["q_lora_rank"]
        latent = {"kv_lora_rank": number("kv_lora_rank"),
                  "q_lora_rank": None if q_lora is None else number("q_lora_rank"), "eps": _LATENT_EPS}  # fmt: skip
    else:
        d_model, n_heads, n_kv_heads, head_dim = rotary_widths(folder, hf)
    n_layers = number("num_hidden_layers")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise UsageError(f"--layer must be a non-negative integer, got {layer!r}")
    if layer >= n_layers:
        raise UsageError(f"{model_type} has {n_layers} layers: no layer {layer}")
    layer_types = _layer_types(hf, family, n_layers) if family.windows == "layer_types" or \
        family.rope_reader == "gemma3" else [FULL] * n_layers  # fmt: skip
    if len(layer_types) != n_layers:
        raise UsageError(f"config.json 'layer_types' has {len(layer_types)} entries for {n_layers} layers")
    layer_type = layer_types[layer]
    if layer_type not in (FULL, SLIDING, CHUNKED):
        raise UsageError(f"{model_type} layer {layer} is of type {layer_type!r}, which attnx's formula does not "
                         f"include (it has {FULL}, {SLIDING} and {CHUNKED}): not imported")  # fmt: skip
    notes = []
    window = None
    if family.windows == "all":
        window = hf["sliding_window"]
    elif family.windows == "layer_types" and layer_type == SLIDING:
        window = hf["sliding_window"] if family.pattern != "qwen" or hf.get("use_sliding_window") else None
        if window is None:
            raise UsageError(f"{model_type} layer {layer} is a {SLIDING} layer but the config has no sliding_window")
    if window is not None:
        window = number("sliding_window", window)
        notes.append(f"layer {layer} ({layer_type}): sliding window {window}")
    chunk = None
    if layer_type == CHUNKED:
        chunk = number("attention_chunk_size")
        notes.append(f"layer {layer} ({layer_type}): chunks of {chunk} tokens, counted from each row's first token")
    rotates = _rope_layers(hf, family, n_layers)[layer]
    rope = l2_norm = temperature = None
    if rotates:
        rope, rope_note = _rope_config(hf, family, model_type, layer_type, rope_dim if family.latent else head_dim)
        if family.interleave_key is not None:
            rope["interleaved"] = bool(hf[family.interleave_key])
            rope_note += f", {family.interleave_key} {rope['interleaved']}"
        notes.append(f"layer {layer} ({layer_type}): {rope_note}" if family.windows == "layer_types" else rope_note)
        if family.l2_norm_key is not None and hf.get(family.l2_norm_key):
            l2_norm = hf["rms_norm_eps"]
            notes.append(f"layer {layer}: q and k normed after the rotation, no weights (eps {l2_norm})")
    else:
        notes.append(f"layer {layer}: no rotation ({family.rope_layers}[{layer}] is 0)")
        if family.temperature and hf.get("attn_temperature_tuning"):
            temperature = {"floor_scale": hf["floor_scale"], "attn_scale": hf["attn_scale"]}
            notes.append(f"layer {layer}: q scaled by log1p(floor((i + 1) / {hf['floor_scale']})) * {hf['attn_scale']}"
                         " + 1 at token index i")  # fmt: skip

    ckpt = Checkpoint(folder)
    names = family.names(layer)
    if ckpt.find(names["o"] + ".weight") is None:
        raise UsageError(f"{model_type} has no layer {layer} ({names['o']}.weight is not in the checkpoint)")
    weights: dict[str, np.ndarray] = {}
    mapping: list[str] = []
    if family.latent:
        weights, mapping, biased = _latent_weights(ckpt, names, latent, hf["attention_bias"])
        notes.append(f"latent: q {'from q_proj' if latent['q_lora_rank'] is None else 'through q_lora_rank ' + str(latent['q_lora_rank'])}, "
                     f"k and v from kv_lora_rank {latent['kv_lora_rank']} + a shared rope key of {rope_dim}; "
                     f"heads of {head_dim} (q, k) and {v_head_dim} (v)")  # fmt: skip
    elif family.fused_qkv:
        key, qkv = ckpt.get(names["qkv"] + ".weight")  # [(N + 2 Nkv) hd, d_model], rows q | k | v
        q_rows, kv_rows = n_heads * head_dim, n_kv_heads * head_dim
        if qkv.shape[0] != q_rows + 2 * kv_rows:
            raise WeightsError(f"{key} has {qkv.shape[0]} rows, expected {q_rows} + 2 * {kv_rows} (q | k | v)")
        parts = {"q_proj": (0, q_rows), "k_proj": (q_rows, q_rows + kv_rows), "v_proj": (q_rows + kv_rows, len(qkv))}
        for ours, (begin, end) in parts.items():
            weights[f"{ours}.weight"] = qkv[begin:end]
            mapping.append(f"{ours}.weight <- {key}[{begin}:{end}] (rows of the fused q|k|v)")
    else:
        for ours, theirs in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            key, weights[f"{ours}.weight"] = ckpt.get(names[theirs] + ".weight")
            mapping.append(f"{ours}.weight <- {key}")
    key, weights["out_proj.weight"] = ckpt.get(names["o"] + ".weight")
    mapping.append(f"out_proj.weight <- {key}")
    if not family.latent:
        biased = {"config": ("q", "k", "v", "o") if hf["attention_bias"] else (), "qkv": ("q", "k", "v"),
                  "none": ()}[family.bias]  # fmt: skip
    for ours, theirs in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
        if not biased:
            break
        if family.latent and ours != "out_proj":
            continue  # the latent's biases are read with its projections
        if theirs in biased:
            key, weights[f"{ours}.bias"] = ckpt.get(names[theirs] + ".bias")
            mapping.append(f"{ours}.bias <- {key}")
        else:  # a projection without bias is one with a zero bias: exact, and attnx's biases go together
            weights[f"{ours}.bias"] = np.zeros(weights[f"{ours}.weight"].shape[0], np.float32)
            mapping.append(f"{ours}.bias <- zeros (the source's {theirs} projection has no bias)")
    qk_norm = None
    if family.qk_norm is not None:
        eps = hf["rms_norm_eps"]
        qk_norm = {"eps": eps}
        for which in ("q_norm", "k_norm"):
            key, w = ckpt.get(f"{names['base']}.{which}.weight")
            if family.qk_norm == "1+w":
                # Gemma's RMSNorm scales by (1 + w), computed in float32: folded into the weight
                weights[f"{which}.weight"] = np.float32(1.0) + w
                mapping.append(f"{which}.weight <- 1 + {key} (Gemma's RMSNorm scales by 1 + w: folded)")
            else:
                weights[f"{which}.weight"] = w
                mapping.append(f"{which}.weight <- {key}")
    if family.sinks:
        key, weights["sinks"] = ckpt.get(f"{names['base']}.sinks")
        mapping.append(f"sinks <- {key}")
    scale = None
    if family.latent and rope is not None:  # transformers' yarn_apply_mscale: the scale times mscale^2
        scale, scale_note = _latent_scale(hf, family, layer_type, head_dim)
        if scale_note:
            notes.append(scale_note)
    if family.scale_key is not None:
        pre = hf[family.scale_key]
        if isinstance(pre, bool) or not isinstance(pre, (int, float)) or not pre > 0:
            raise UsageError(f"{folder!r} config.json: {family.scale_key!r} must be a positive number, got {pre!r}")
        scale = float(pre) ** -0.5  # transformers: query_pre_attn_scalar ** -0.5, whatever head_dim is
        notes.append(f"scale {family.scale_key}^-1/2 = {pre}^-1/2 = {scale!r}")
    softcap = hf.get(family.softcap_key) if family.softcap_key is not None else None
    try:
        config = AttentionConfig(
            d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
            bias=bool(biased), causal=True, key_padding_mask=True if key_padding_mask is None else key_padding_mask,
            scale=scale, rope=rope, sliding_window=window, softcap=softcap, qk_norm=qk_norm, sinks=family.sinks,
            qk_l2_norm=l2_norm, attn_temperature=temperature, attention_chunk=chunk, v_head_dim=v_head_dim,
            latent=latent,
        )  # fmt: skip
    except UsageError as e:
        raise WeightsError(f"{folder!r}: layer {layer} does not fit attnx's config: {e}") from None
    check_weights(config, weights, f"{folder!r} layer {layer}")
    check_finite(weights, f"{folder!r} layer {layer}")
    if ckpt.converted:
        notes.append(f"tensors stored as {', '.join(sorted(ckpt.converted))} converted to float32")
    notes.append("imported: the attention block only (its projections, q/k norms, sinks); the layer norms, "
                 "residuals and MLP around it are not part of attnx's formula")  # fmt: skip
    return ImportResult(config, weights, f"{folder} ({model_type}, decoder self-attention, layer {layer})",
                        mapping, notes, model_type, layer, "decoder", "self")  # fmt: skip
