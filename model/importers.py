"""Importing the attention layers people have: tables of Hugging Face architectures, read from
a checkpoint folder (config.json and *.safetensors, sharded included) with no torch, no
transformers and no network, into attnx's contract (an AttentionConfig and its weights).

    ARCHITECTURES[model_type][(stack, attention)] -> Layout: where the four projections are,
    how they are stored, the config keys of the widths and head count, masks and scale.
    ROTARY_FAMILIES[model_type] -> RotaryFamily: the rotary decoders (Llama, Mistral, Qwen2/3,
    Gemma 2/3, Phi-3, gpt-oss, Llama 4, DeepSeek-V2/V3, MiniCPM3), their config read as transformers reads it (class
    defaults, both spellings of the rope keys) into the modern-LLM keys: rope, sliding_window, softcap,
    qk_norm, sinks, latent (DeepSeek's multi-head latent attention).
    ALIBI_FAMILIES[model_type] -> AlibiFamily: the ALiBi decoders (BLOOM, MPT), their fused q/k/v
    projection split into attnx's, into the `alibi` key.

Every tensor the import reads and how it became an attnx tensor (transposed, split, a zero bias
for a projection that has none) is recorded in ImportResult.mapping. What attnx's formula does
not include is refused by name, never approximated: T5's self-attention adds a relative position
bias, BERT's relative_key variants add position terms, Kimi K2's own model_type has no transformers class to
check against, Falcon's ALiBi is scaled and rounded to bfloat16 (measurements/alibi_transformers), dynamic NTK
rope depends on each run's length. A pickle checkpoint (pytorch_model.bin) is refused, never unpickled.

The pieces: the tables (attnx.model.families), the safetensors reading (attnx.model.checkpoint), the rotary and
ALiBi decoders' import (attnx.model._import_llm); here, the import itself, the projections read alone (what the
audit pairs layers by) and writing an import's folder.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnx._io import Staging, output_lock
from attnx.errors import UsageError, WeightsError
from attnx.model._import_llm import import_alibi, import_rotary, rotary_widths
from attnx.model.checkpoint import Checkpoint, checkpoint_files, fp8_blocks, read_checkpoint_config
from attnx.model.config import AttentionConfig
from attnx.model.families import (
    _FALCON_ALIBI,
    ALIBI_FAMILIES,
    ARCHITECTURES,
    KNOWN_ARCHITECTURES,
    NOT_EXPRESSIBLE,
    ROTARY_FAMILIES,
    AlibiFamily,
    ImportResult,
    Layout,
    RotaryFamily,
)
from attnx.model.weights import check_finite, check_weights, from_torch_mha, save_weights

__all__ = [
    "ARCHITECTURES",
    "ROTARY_FAMILIES",
    "ALIBI_FAMILIES",
    "AlibiFamily",
    "KNOWN_ARCHITECTURES",
    "RotaryFamily",
    "Layout",
    "ImportResult",
    "PROJECTIONS",
    "import_weights",
    "read_checkpoint_config",
    "projection_shape",
    "read_projection",
    "write_import",
    "check_import_target",
    "checkpoint_files",
]

# The import ---------------------------------------------------------------------------------------
def import_weights(
    source: Any,
    *,
    layer: int = 0,
    attention: str = "self",
    stack: str | None = None,
    key_padding_mask: bool | None = None,
    kv_cache: bool = False,
) -> ImportResult:
    """The attnx config and weights of one attention layer of `source`: a Hugging Face checkpoint
    folder (a path; `layer`, `attention` self|cross, `stack` encoder|decoder where the architecture
    has both), or a torch.nn.MultiheadAttention module (attnx.model.from_torch_mha). key_padding_mask
    None: the architecture's default (text models take one, ViT and Whisper's encoder do not).
    kv_cache: the config of the layer's step model (docs/concepts/step-forms.md), for a causal self-attention."""
    result = _import(source, layer, attention, stack, key_padding_mask)
    if kv_cache:
        if not result.config.causal:
            raise UsageError(f"--kv-cache needs a causal self-attention layer; {result.source} is not causal")
        result.config = dataclasses.replace(result.config, kv_cache=True)
    return result


def _import(source: Any, layer: int, attention: str, stack: str | None, key_padding_mask: bool | None) -> ImportResult:
    if not isinstance(source, (str, os.PathLike)):
        config, weights = from_torch_mha(source, key_padding_mask=bool(key_padding_mask))
        return ImportResult(config, weights, "torch.nn.MultiheadAttention", _mha_mapping(source, config), [])
    folder = os.fspath(source)
    hf = read_checkpoint_config(folder)
    model_type = hf.get("model_type")
    if model_type in NOT_EXPRESSIBLE:
        raise UsageError(f"model_type {model_type!r}: {NOT_EXPRESSIBLE[model_type]}: not imported")
    if model_type == "falcon" and hf.get("alibi"):
        raise UsageError(f"falcon with alibi: {_FALCON_ALIBI}: not imported")
    if isinstance(quantized := hf.get("quantization_config"), dict) and fp8_blocks(hf) is None:  # before any read
        method = quantized.get("quant_method", "unnamed")
        block = quantized.get("weight_block_size")
        raise UsageError(f"{folder}: its weights are quantized (quantization_config: quant_method {method!r}"
                         + (f", blocks of {block[0]}x{block[1]}" if isinstance(block, list) and len(block) == 2 else "")
                         + "): attnx imports float weights (F32, F16, BF16) and FP8 blocks (quant_method fp8 with "
                         "weight_block_size, as DeepSeek-V3 publishes them); save a dequantized copy and import it "
                         "(transformers: load with the quantizer's dequantize=True, then save_pretrained)")  # fmt: skip
    multimodal = {"gemma3": ("Gemma 3", "gemma3_text", "Gemma 3 1B, or the text model saved on its own"),
                  "llama4": ("Llama 4", "llama4_text", "Llama4ForCausalLM's text model saved on its own"),
                  "kimi_k25": ("Kimi K2.5", "deepseek_v3 or kimi_k2", "its text model saved on its own")}  # fmt: skip
    if model_type in multimodal:
        name, text, how = multimodal[model_type]
        raise UsageError(f"model_type {model_type!r} is {name}'s multimodal checkpoint (its text model's config "
                         "under text_config, its layers beside a vision tower's): not in the table yet; a "
                         f"{text} checkpoint ({how}) imports")  # fmt: skip
    if model_type in ROTARY_FAMILIES or model_type in ALIBI_FAMILIES:
        if attention != "self" or stack not in (None, "decoder"):
            raise UsageError(f"{model_type} is a decoder: it has decoder self-attention only")
        if model_type in ALIBI_FAMILIES:
            return import_alibi(folder, hf, model_type, layer, key_padding_mask)
        return import_rotary(folder, hf, model_type, layer, key_padding_mask)
    if model_type not in ARCHITECTURES:
        raise UsageError(f"unknown architecture {model_type!r} (known: {', '.join(KNOWN_ARCHITECTURES)})")
    blocks = ARCHITECTURES[model_type]
    if attention not in ("self", "cross"):
        raise UsageError(f"--attention must be self or cross, got {attention!r}")
    stacks = sorted({s for s, a in blocks if a == attention})
    if not stacks:
        raise UsageError(f"{model_type} has no {attention}-attention (it has: {', '.join(sorted({a for _, a in blocks}))})")
    stack = stack or ("encoder" if "encoder" in stacks else stacks[0])
    if (stack, attention) not in blocks:
        raise UsageError(f"{model_type} has no {stack} {attention}-attention (its {attention}-attention: {', '.join(stacks)})")
    lay = blocks[(stack, attention)]
    if lay.refuse:
        raise UsageError(f"{model_type} {stack} {attention}-attention: {lay.refuse}")
    if model_type in ("bert", "roberta") and hf.get("position_embedding_type", "absolute") != "absolute":
        raise UsageError(f"{model_type} with position_embedding_type {hf['position_embedding_type']!r} adds relative "
                         "position terms to its scores, which attnx's formula does not include: not imported")  # fmt: skip
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise UsageError(f"--layer must be a non-negative integer, got {layer!r}")

    def number(key: str) -> int:
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{folder!r} config.json: {key!r} must be a positive integer, got {value!r}")
        return value

    d_model, n_heads = number(lay.width), number(lay.heads)
    head_dim = number(lay.head_dim) if lay.head_dim else None
    scale = _scale(model_type, hf, layer, lay)
    ckpt = Checkpoint(folder)
    names = lay.names(layer)
    if ckpt.find(names["o"] + ".weight") is None:
        raise UsageError(f"{model_type} has no {stack} layer {layer} ({names['o']}.weight is not in the checkpoint)")
    mapping: list[str] = []
    weights: dict[str, np.ndarray] = {}
    if lay.storage == "conv1d-packed":
        key, packed = ckpt.get(names["q"] + ".weight")  # [in, 3*out]
        q, k, v = np.split(packed.T, 3)
        weights.update({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v})
        mapping += [f"{n}.weight <- {key} (Conv1D [in, 3*out]: transposed, split q|k|v part {i + 1}/3)"
                    for i, n in enumerate(("q_proj", "k_proj", "v_proj"))]  # fmt: skip
        key, packed_bias = ckpt.get(names["q"] + ".bias")
        for i, (n, b) in enumerate(zip(("q_proj", "k_proj", "v_proj"), np.split(packed_bias, 3))):
            weights[f"{n}.bias"] = b
            mapping.append(f"{n}.bias <- {key} (split q|k|v part {i + 1}/3)")
        key, o = ckpt.get(names["o"] + ".weight")
        weights["out_proj.weight"] = o.T
        mapping.append(f"out_proj.weight <- {key} (Conv1D [in, out]: transposed)")
        key, weights["out_proj.bias"] = ckpt.get(names["o"] + ".bias")
        mapping.append(f"out_proj.bias <- {key}")
    else:
        for ours, theirs in zip(("q_proj", "k_proj", "v_proj", "out_proj"), ("q", "k", "v", "o")):
            key, weights[f"{ours}.weight"] = ckpt.get(names[theirs] + ".weight")
            mapping.append(f"{ours}.weight <- {key}")
            if lay.bias == "none":
                continue
            if lay.bias == "no-k" and theirs == "k":
                # a projection without bias is one with a zero bias: exact, and attnx's biases go together
                weights["k_proj.bias"] = np.zeros(weights["k_proj.weight"].shape[0], np.float32)
                mapping.append("k_proj.bias <- zeros (the source's k projection has no bias)")
                continue
            key, weights[f"{ours}.bias"] = ckpt.get(names[theirs] + ".bias")
            mapping.append(f"{ours}.bias <- {key}")
    q_rows, k_cols = weights["q_proj.weight"].shape[0], weights["k_proj.weight"].shape[1]
    try:
        config = AttentionConfig(
            d_model=d_model,
            n_heads=n_heads,
            head_dim=head_dim if head_dim is not None else (q_rows // n_heads if q_rows % n_heads == 0 else None),
            v_head_dim=weights["v_proj.weight"].shape[0] // n_heads,
            kv_dim=k_cols if lay.cross else None,
            bias=lay.bias != "none",
            causal=lay.causal,
            cross=lay.cross,
            key_padding_mask=lay.key_padding_mask if key_padding_mask is None else key_padding_mask,
            scale=scale,
        )
    except UsageError as e:
        raise WeightsError(f"{folder!r}: the tensors of {stack} layer {layer} do not fit its config.json: {e}") from None
    check_weights(config, weights, f"{folder!r} {stack} layer {layer}")
    check_finite(weights, f"{folder!r} {stack} layer {layer}")
    notes = []
    if ckpt.converted:
        notes.append(f"tensors stored as {', '.join(sorted(ckpt.converted))} converted to float32")
    notes.append("imported: the attention block only (its projections); the layer norms, residuals and "
                 "position embeddings around it are not part of attnx's formula")  # fmt: skip
    return ImportResult(config, weights, f"{folder} ({model_type}, {stack} {attention}-attention, layer {layer})",
                        mapping, notes, model_type, layer, stack, attention)  # fmt: skip


def _mha_mapping(module: Any, config: AttentionConfig) -> list[str]:
    """How from_torch_mha read nn.MultiheadAttention's tensors (packed in_proj, or q/k/v apart)."""
    q, v = config.q_dim, config.v_dim
    rows = {"q_proj": f"[0:{q}]", "k_proj": f"[{q}:{2 * q}]", "v_proj": f"[{2 * q}:{2 * q + v}]"}
    packed = getattr(module, "in_proj_weight", None) is not None
    out = [f"{n}.weight <- in_proj_weight{rows[n]} (rows)" if packed else f"{n}.weight <- {n[0]}_proj_weight"
           for n in rows]  # fmt: skip
    if config.bias:
        out += [f"{n}.bias <- in_proj_bias{rows[n]}" for n in rows]
    out.append("out_proj.weight <- out_proj.weight")
    if config.bias:
        out.append("out_proj.bias <- out_proj.bias")
    return out


def _scale(model_type: str, hf: Mapping[str, Any], layer: int, lay: Layout) -> float | None:
    """The softmax scale where it is not attnx's default 1/sqrt(head_dim)."""
    if lay.unit_scale:
        return 1.0
    if model_type == "gpt2":
        head_dim = hf["n_embd"] / hf["n_head"]
        scale = 1 / math.sqrt(head_dim) if hf.get("scale_attn_weights", True) else 1.0
        if hf.get("scale_attn_by_inverse_layer_idx", False):
            scale /= layer + 1
        return None if scale == 1 / math.sqrt(head_dim) else scale
    return None


# attnx's name of each projection's weight, [out, in] as import_weights gives it
PROJECTIONS = {"q": "q_proj.weight", "k": "k_proj.weight", "v": "v_proj.weight", "o": "out_proj.weight"}


def _rotary_projection(folder: str, layer: int, role: str) -> tuple[Checkpoint, str, int | None, tuple[int, int]] | None:
    """Where a rotary decoder's projection lies in its checkpoint: (the checkpoint, the tensor, its first row in a
    fused tensor or None where the tensor is the projection, its [out, in] shape), read from the headers alone; None
    for another architecture."""
    if role not in PROJECTIONS:
        raise UsageError(f"projection {role!r}: one of {', '.join(PROJECTIONS)}")
    hf = read_checkpoint_config(folder)
    model_type = hf.get("model_type")
    family = ROTARY_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        return None
    _, n_heads, n_kv_heads, head_dim = rotary_widths(folder, {**family.defaults, **hf})
    names, ckpt = family.names(layer), Checkpoint(folder)
    fused = family.fused_qkv and role != "o"  # [(N + 2 Nkv) hd, d_model], rows q | k | v
    name = names["qkv" if fused else role] + ".weight"
    key, shape = ckpt.shape(name)
    if not isinstance(shape, list) or len(shape) != 2:
        raise WeightsError(f"{os.path.basename(ckpt.files[key])}: tensor {key!r} is not a matrix (shape {shape})")
    if not fused:
        return ckpt, name, None, (int(shape[0]), int(shape[1]))
    start, count = {"q": (0, n_heads), "k": (n_heads, n_kv_heads), "v": (n_heads + n_kv_heads, n_kv_heads)}[role]
    return ckpt, name, start * head_dim, (count * head_dim, int(shape[1]))


def projection_shape(source: str | os.PathLike[str], layer: int, role: str = "q") -> tuple[int, int]:
    """The [out, in] shape of one projection of a decoder layer (read_projection), from the headers alone where the
    architecture allows."""
    where = _rotary_projection(os.fspath(source), layer, role)
    return where[3] if where is not None else tuple(read_projection(source, layer, role).shape)  # type: ignore[return-value]


def read_projection(source: str | os.PathLike[str], layer: int, role: str = "q",
                    rows: Sequence[int] | None = None) -> np.ndarray:  # fmt: skip
    """One projection of one decoder layer of a checkpoint folder (role q, k, v or o), [out, in] as import_weights
    gives it; rows: only those rows. A rotary decoder's (ROTARY_FAMILIES) is read alone, that tensor's bytes and no
    other, and of it only the rows asked for (Phi-3's q, k, v: their rows of its fused q|k|v): what `attnx audit`
    pairs a graph's blocks with the checkpoint's layers by, before it imports the one layer a block is checked
    against. Other architectures: the layer's attention imported (import_weights) and the projection kept."""
    folder = os.fspath(source)
    where = _rotary_projection(folder, layer, role)
    if where is None:
        weight = import_weights(folder, layer=layer).weights[PROJECTIONS[role]]
        return weight if rows is None else np.array(weight[list(rows)])
    ckpt, name, start, shape = where
    if start is None:
        return ckpt.get(name, rows)[1]
    wanted = range(shape[0]) if rows is None else rows
    if any(not 0 <= int(r) < shape[0] for r in wanted):
        raise WeightsError(f"{folder!r}: layer {layer}'s {role} projection {list(shape)} has no rows {list(wanted)[:4]}")
    return ckpt.get(name, [start + int(r) for r in wanted])[1]


# Writing ------------------------------------------------------------------------------------------
IMPORT_FILES = ("config.json", "weights.safetensors")


def write_import(result: ImportResult, out: str | os.PathLike[str], *, force: bool = False) -> list[str]:
    """The attnx folder `out`: config.json and weights.safetensors (the contract `attnx export
    --config --weights` reads), staged and published whole (attnx._io.Staging)."""
    out = os.path.abspath(os.fspath(out))
    check_import_target(out, force)
    with output_lock(out), Staging(out, folder=True) as stage:
        with open(stage.path("config.json"), "w", encoding="utf-8") as f:
            f.write(result.config.to_json() + "\n")
        save_weights(result.weights, stage.path("weights.safetensors"))
        stage.publish(replace_folder=lambda target: check_import_target(target, force))
    return [os.path.join(out, name) for name in IMPORT_FILES]


def check_import_target(out: str, force: bool) -> None:
    """An existing output folder is replaced only with force, and only when it holds nothing
    but an earlier import's two files."""
    if not os.path.lexists(out):
        if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
            raise UsageError(f"--out folder {os.path.dirname(os.path.abspath(out))!r} does not exist")
        return
    if not force:
        raise UsageError(f"{out!r} already exists (pass --force to replace an earlier import)")
    if os.path.islink(out) or not os.path.isdir(out):
        raise UsageError(f"{out!r} exists and is not a folder: not replacing it")
    extra = sorted(set(os.listdir(out)) - set(IMPORT_FILES))
    if extra:
        raise UsageError(f"{out!r} holds files an import does not write ({', '.join(extra[:5])}): not replacing it")
