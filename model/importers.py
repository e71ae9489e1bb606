"""Importing the attention layers people have: tables of Hugging Face architectures, read from
a checkpoint folder (config.json and *.safetensors, sharded included) with no torch, no
transformers and no network, into attnx's contract (an AttentionConfig and its weights).

    ARCHITECTURES[model_type][(stack, attention)] -> Layout: where the four projections are,
    how they are stored, the config keys of the widths and head count, masks and scale.
    ROTARY_FAMILIES[model_type] -> RotaryFamily: the rotary decoders (Llama, Mistral, Qwen2/3,
    Gemma 2/3, Phi-3, gpt-oss), their config read as transformers reads it (class defaults, both
    spellings of the rope keys) into the modern-LLM keys: rope, sliding_window, softcap, qk_norm, sinks.
    ALIBI_FAMILIES[model_type] -> AlibiFamily: the ALiBi decoders (BLOOM, MPT), their fused q/k/v
    projection split into attnx's, into the `alibi` key.

Every tensor the import reads and how it became an attnx tensor (transposed, split, a zero bias
for a projection that has none) is recorded in ImportResult.mapping. What attnx's formula does
not include is refused by name, never approximated: T5's self-attention adds a relative position
bias, BERT's relative_key variants add position terms, DeepSeek's latent attention (MLA) factors
its scores otherwise, Falcon's ALiBi is scaled and rounded to bfloat16 (measurements/alibi_transformers), dynamic NTK
rope depends on each run's length. A pickle checkpoint (pytorch_model.bin) is refused, never unpickled.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnx._io import Staging, output_lock
from attnx.errors import UsageError, WeightsError
from attnx.model.config import AttentionConfig
from attnx.model.rope import REFUSED_ROPE_TYPES
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
    "import_weights",
    "read_checkpoint_config",
    "projection_shape",
    "read_projection",
    "write_import",
    "check_import_target",
    "checkpoint_files",
]

MAX_HEADER_BYTES = 100 * 1024**2  # a safetensors header past this is not one


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
# Architectures whose layers attnx's formula cannot reproduce, and why (checked before anything is read).
_MLA = ("multi-head latent attention (MLA): q, k and v come from low-rank latents and only part of each "
        "head is rotated (a separate rope key head), which attnx's formula does not include")
# transformers 5.24's Falcon (models/falcon/modeling_falcon.py; measured: measurements/alibi_transformers)
_FALCON_ALIBI = ("transformers' Falcon adds its ALiBi bias before the scale (slope / sqrt(head_dim) per unit of "
                 "distance, not the slopes of BLOOM and MPT) and rounds the slopes and each slope * position to "
                 "bfloat16 (build_alibi_tensor: 1.1 off in the scores at position 2047 of Falcon-RW-1B's 32 "
                 "heads), which attnx's alibi (float slopes, after the scale) does not include; its eager "
                 "attention also adds the bias twice, its sdpa attention and Falcon-RW's own code once")
NOT_EXPRESSIBLE = {
    **{t: _MLA for t in ("deepseek_v2", "deepseek_v3", "kimi_k2", "minicpm3")},
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


# Reading a checkpoint -----------------------------------------------------------------------------
def read_checkpoint_config(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise UsageError(f"{folder!r} is not a checkpoint folder" + (": it does not exist" if not os.path.exists(folder) else ""))
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise UsageError(f"{folder!r} has no config.json: not a Hugging Face checkpoint folder") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{path!r} is not a readable JSON config: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path!r} is not a JSON object")
    return config


def _weight_files(folder: str) -> dict[str, str]:
    """{tensor name: safetensors file} from model.safetensors or a sharded index; a checkpoint
    holding only pickles is refused."""
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index!r} is not a safetensors index: {e}") from None
        files = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise WeightsError(f"{index!r} names shard {shard!r}: only plain file names in the folder are read")
            files[name] = os.path.join(folder, shard)
        return files
    if os.path.isfile(single):
        return {name: single for name in _header(single)}
    pickles = [n for n in sorted(os.listdir(folder)) if n.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    if pickles:
        raise WeightsError(
            f"{folder!r} holds its weights only as pickles ({', '.join(pickles[:3])}): refused, never unpickled; "
            "save the model with safetensors (save_pretrained(safe_serialization=True))"
        )
    raise WeightsError(f"{folder!r} has no model.safetensors nor model.safetensors.index.json")


def checkpoint_files(folder: str) -> list[str]:
    """The names of the files in a checkpoint folder that importing it reads: config.json, then
    model.safetensors, or the sharded index and every shard it names (plain names, _weight_files' rule)."""
    read_checkpoint_config(folder)
    index = "model.safetensors.index.json"
    shards = sorted({os.path.basename(p) for p in _weight_files(folder).values()})
    return ["config.json", *([index] if os.path.isfile(os.path.join(folder, index)) else []), *shards]


def _header(path: str) -> dict[str, Any]:
    """The safetensors header of `path`: {name: {dtype, shape, data_offsets}}."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise WeightsError(f"{path!r} is not a readable safetensors file: {e}") from None
    header.pop("__metadata__", None)
    return header


# numpy types of the safetensors dtypes a weight may have (BF16 is widened by hand: numpy has none).
_SAFETENSORS_TYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _read(path: str, name: str, entry: Mapping[str, Any], converted: set[str],
          rows: Sequence[int] | None = None) -> np.ndarray:  # fmt: skip
    """One tensor as float32, read from its byte range (only the tensors an import needs are read); rows: of a
    matrix, only these rows' bytes are read (a sample), in that order."""
    dtype = entry.get("dtype")
    if dtype not in _SAFETENSORS_TYPES:
        raise WeightsError(f"{os.path.basename(path)}: tensor {name!r} has dtype {dtype}, expected a float dtype")
    begin, end = entry["data_offsets"]
    item = np.dtype(_SAFETENSORS_TYPES[dtype]).itemsize
    shape = list(entry["shape"])
    if end - begin != math.prod(shape) * item:
        raise WeightsError(f"{os.path.basename(path)}: tensor {name!r} is truncated")
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if rows is None:
            f.seek(8 + size + begin)
            raw = f.read(end - begin)
        else:  # [rows, columns]: each row's bytes alone
            if len(shape) != 2 or any(not 0 <= r < shape[0] for r in rows):
                raise WeightsError(f"{os.path.basename(path)}: tensor {name!r} {shape} has no rows {list(rows)[:4]}")
            width = shape[1] * item
            parts = []
            for r in rows:
                f.seek(8 + size + begin + int(r) * width)
                parts.append(f.read(width))
            raw, shape = b"".join(parts), [len(rows), shape[1]]
    array = np.frombuffer(raw, dtype=np.dtype(_SAFETENSORS_TYPES[dtype]).newbyteorder("<"))
    if array.size != math.prod(shape):
        raise WeightsError(f"{os.path.basename(path)}: tensor {name!r} is truncated")
    if dtype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    if dtype != "F32":
        converted.add(dtype)
    return np.array(array, dtype=np.float32).reshape(shape)


class _Checkpoint:
    """The tensors of a checkpoint folder by name; a name is found whatever prefix the saving
    class put before it ("bert.", "model.", "transformer.")."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.files = _weight_files(folder)
        self.headers: dict[str, dict[str, Any]] = {}
        self.converted: set[str] = set()

    def find(self, name: str) -> str | None:
        hits = [k for k in self.files if k == name or k.endswith("." + name)]
        if len(hits) > 1:
            raise WeightsError(f"{self.folder!r}: tensor {name!r} is ambiguous ({', '.join(sorted(hits)[:3])})")
        return hits[0] if hits else None

    def get(self, name: str, rows: Sequence[int] | None = None) -> tuple[str, np.ndarray]:
        """(its key, the tensor) of `name`; rows: only those rows of a matrix (_read)."""
        key = self.find(name)
        if key is None:
            raise WeightsError(f"{self.folder!r} has no tensor {name!r}: not the layer or architecture it claims")
        path = self.files[key]
        if path not in self.headers:
            self.headers[path] = _header(path)
        if key not in self.headers[path]:
            raise WeightsError(f"{os.path.basename(path)} has no tensor {key!r}, which its index names")
        return key, _read(path, key, self.headers[path][key], self.converted, rows)


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
    if model_type == "gemma3":
        raise UsageError("model_type 'gemma3' is Gemma 3's multimodal checkpoint (its text model's config under "
                         "text_config, its layers beside a vision tower's): not in the table yet; a gemma3_text "
                         "checkpoint (Gemma 3 1B, or the text model saved on its own) imports")  # fmt: skip
    if model_type in ROTARY_FAMILIES or model_type in ALIBI_FAMILIES:
        if attention != "self" or stack not in (None, "decoder"):
            raise UsageError(f"{model_type} is a decoder: it has decoder self-attention only")
        if model_type in ALIBI_FAMILIES:
            return _import_alibi(folder, hf, model_type, layer, key_padding_mask)
        return _import_rotary(folder, hf, model_type, layer, key_padding_mask)
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
    ckpt = _Checkpoint(folder)
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


# Rotary decoders ----------------------------------------------------------------------------------
# The modern-LLM families (docs/concepts/formula.md, "Modern LLM attention"): their attention is attnx's formula with
# the config keys rope, sliding_window, softcap, qk_norm and sinks. Their config.json is read as
# transformers (5.24) reads it: each family's config class fills in defaults for the keys a
# checkpoint omits, and the rope keys come in two spellings, the older rope_theta + rope_scaling and
# the newer rope_parameters (nested by layer type for Gemma 3). Every default is resolved here and
# written as a number.
FULL, SLIDING = "full_attention", "sliding_attention"
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
    pattern: str = "alternating"  # layer_types when the config gives none: "alternating", "qwen", "gemma3"
    scale_key: str | None = None  # the config key whose ^-1/2 is the scale (Gemma); None: head_dim^-1/2
    softcap_key: str | None = None  # the config key of the scores' softcap (Gemma)
    rope_reader: str = "standard"  # transformers' convert_rope_params_to_dict: "standard", "gemma3", "phi3"
    partial_rotary: bool = False  # whether its attention rotates only the first dims (Phi-3 slices q and k)

    def names(self, layer: int) -> dict[str, str]:
        base = f"layers.{layer}.self_attn"
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
    "gpt_oss": RotaryFamily({**_COMMON, "hidden_size": 2880, "num_attention_heads": 64, "num_key_value_heads": 8,
                             "head_dim": 64, "max_position_embeddings": 131072, "attention_bias": True,
                             "sliding_window": 128, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
                             "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 4096}},
                            sinks=True, windows="layer_types"),
}  # fmt: skip

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


def _import_alibi(folder: str, hf: Mapping[str, Any], model_type: str, layer: int,
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
    ckpt = _Checkpoint(folder)
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


KNOWN_ARCHITECTURES = (*ARCHITECTURES, *ROTARY_FAMILIES, *ALIBI_FAMILIES)

def _layer_types(hf: Mapping[str, Any], family: RotaryFamily, n_layers: int) -> list[str]:
    """config.layer_types, or the pattern the family's config class fills in when it has none."""
    given = hf.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or not all(isinstance(t, str) for t in given):
            raise UsageError(f"config.json 'layer_types' must be a list of names, got {given!r}")
        return [_LAYER_TYPE_NAMES.get(t, t) for t in given]
    if family.pattern == "qwen":
        window = hf["sliding_window"] if hf.get("use_sliding_window") else None
        return [SLIDING if window is not None and i >= hf["max_window_layers"] else FULL for i in range(n_layers)]
    period = hf["sliding_window_pattern"] if family.pattern == "gemma3" else 2
    return [SLIDING if (i + 1) % period else FULL for i in range(n_layers)]


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
    rope = {"theta": params["rope_theta"], "dim": dim, "interleaved": False, "scaling": scaling}
    return rope, f"rope: rope_type {kind}, theta {params['rope_theta']}, {dim} of {head_dim} dims rotated"


def _rotary_widths(folder: str, hf: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(d_model, n_heads, n_kv_heads, head_dim) of a rotary decoder's config (its family's defaults merged in)."""

    def number(key: str, value: Any = None) -> int:
        value = hf.get(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{folder!r} config.json: {key!r} must be a positive integer, got {value!r}")
        return value

    d_model, n_heads = number("hidden_size"), number("num_attention_heads")
    n_kv_heads = number("num_key_value_heads", hf["num_key_value_heads"] or n_heads)
    return d_model, n_heads, n_kv_heads, number("head_dim", hf["head_dim"] or d_model // n_heads)


# attnx's name of each projection's weight, [out, in] as import_weights gives it
PROJECTIONS = {"q": "q_proj.weight", "k": "k_proj.weight", "v": "v_proj.weight", "o": "out_proj.weight"}


def _rotary_projection(folder: str, layer: int, role: str) -> tuple[_Checkpoint, str, int | None, tuple[int, int]] | None:
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
    _, n_heads, n_kv_heads, head_dim = _rotary_widths(folder, {**family.defaults, **hf})
    names, ckpt = family.names(layer), _Checkpoint(folder)
    fused = family.fused_qkv and role != "o"  # [(N + 2 Nkv) hd, d_model], rows q | k | v
    name = names["qkv" if fused else role] + ".weight"
    key = ckpt.find(name)
    if key is None:
        raise WeightsError(f"{folder!r} has no tensor {name!r}: not the layer or architecture it claims")
    path = ckpt.files[key]
    ckpt.headers.setdefault(path, _header(path))
    shape = ckpt.headers[path].get(key, {}).get("shape")
    if not isinstance(shape, list) or len(shape) != 2:
        raise WeightsError(f"{os.path.basename(path)}: tensor {key!r} is not a matrix (shape {shape})")
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


def _import_rotary(folder: str, hf: Mapping[str, Any], model_type: str, layer: int,
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

    d_model, n_heads, n_kv_heads, head_dim = _rotary_widths(folder, hf)
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
    if layer_type not in (FULL, SLIDING):
        raise UsageError(f"{model_type} layer {layer} is of type {layer_type!r}, which attnx's formula does not "
                         f"include (it has {FULL} and {SLIDING}): not imported")  # fmt: skip
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
    rope, rope_note = _rope_config(hf, family, model_type, layer_type, head_dim)
    notes.append(f"layer {layer} ({layer_type}): {rope_note}" if family.windows == "layer_types" else rope_note)

    ckpt = _Checkpoint(folder)
    names = family.names(layer)
    if ckpt.find(names["o"] + ".weight") is None:
        raise UsageError(f"{model_type} has no layer {layer} ({names['o']}.weight is not in the checkpoint)")
    weights: dict[str, np.ndarray] = {}
    mapping: list[str] = []
    if family.fused_qkv:
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
    biased = {"config": ("q", "k", "v", "o") if hf["attention_bias"] else (), "qkv": ("q", "k", "v"),
              "none": ()}[family.bias]  # fmt: skip
    for ours, theirs in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("out_proj", "o")):
        if not biased:
            break
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
