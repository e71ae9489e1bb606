"""Importing the attention layers people have: one table of Hugging Face architectures, read from
a checkpoint folder (config.json and *.safetensors, sharded included) with no torch, no
transformers and no network, into attnx's contract (an AttentionConfig and its weights).

    ARCHITECTURES[model_type][(stack, attention)] -> Layout: where the four projections are,
    how they are stored, the config keys of the widths and head count, masks and scale.

Every tensor the import reads and how it became an attnx tensor (transposed, split, a zero bias
for a projection that has none) is recorded in ImportResult.mapping. What attnx's formula does
not include is refused by name, never approximated: T5's self-attention adds a relative position
bias, BERT's relative_key variants add position terms, rotary models (Llama, Mistral, Qwen) rotate
q and k. A pickle checkpoint (pytorch_model.bin) is refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from attnx._io import Staging, output_lock
from attnx.errors import UsageError, WeightsError
from attnx.model.config import AttentionConfig
from attnx.model.weights import check_finite, check_weights, from_torch_mha, save_weights

__all__ = [
    "ARCHITECTURES",
    "Layout",
    "ImportResult",
    "import_weights",
    "read_checkpoint_config",
    "write_import",
    "check_import_target",
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
NOT_EXPRESSIBLE = {
    t: "its attention rotates q and k by their positions (rotary embeddings) and shares key/value heads between "
    "query heads, neither of which attnx's formula includes"
    for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral")
}


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


def _read(path: str, name: str, entry: Mapping[str, Any], converted: set[str]) -> np.ndarray:
    """One tensor as float32, read from its byte range (only the tensors an import needs are read)."""
    dtype = entry.get("dtype")
    if dtype not in _SAFETENSORS_TYPES:
        raise WeightsError(f"{os.path.basename(path)}: tensor {name!r} has dtype {dtype}, expected a float dtype")
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + size + begin)
        raw = f.read(end - begin)
    array = np.frombuffer(raw, dtype=np.dtype(_SAFETENSORS_TYPES[dtype]).newbyteorder("<"))
    if array.size != math.prod(entry["shape"]):
        raise WeightsError(f"{os.path.basename(path)}: tensor {name!r} is truncated")
    if dtype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    if dtype != "F32":
        converted.add(dtype)
    return np.array(array, dtype=np.float32).reshape(entry["shape"])


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

    def get(self, name: str) -> tuple[str, np.ndarray]:
        key = self.find(name)
        if key is None:
            raise WeightsError(f"{self.folder!r} has no tensor {name!r}: not the layer or architecture it claims")
        path = self.files[key]
        if path not in self.headers:
            self.headers[path] = _header(path)
        if key not in self.headers[path]:
            raise WeightsError(f"{os.path.basename(path)} has no tensor {key!r}, which its index names")
        return key, _read(path, key, self.headers[path][key], self.converted)


# The import ---------------------------------------------------------------------------------------
def import_weights(
    source: Any,
    *,
    layer: int = 0,
    attention: str = "self",
    stack: str | None = None,
    key_padding_mask: bool | None = None,
) -> ImportResult:
    """The attnx config and weights of one attention layer of `source`: a Hugging Face checkpoint
    folder (a path; `layer`, `attention` self|cross, `stack` encoder|decoder where the architecture
    has both), or a torch.nn.MultiheadAttention module (attnx.model.from_torch_mha). key_padding_mask
    None: the architecture's default (text models take one, ViT and Whisper's encoder do not)."""
    if not isinstance(source, (str, os.PathLike)):
        config, weights = from_torch_mha(source, key_padding_mask=bool(key_padding_mask))
        return ImportResult(config, weights, "torch.nn.MultiheadAttention", _mha_mapping(source, config), [])
    folder = os.fspath(source)
    hf = read_checkpoint_config(folder)
    model_type = hf.get("model_type")
    if model_type in NOT_EXPRESSIBLE:
        raise UsageError(f"model_type {model_type!r}: {NOT_EXPRESSIBLE[model_type]}: not imported")
    if model_type not in ARCHITECTURES:
        raise UsageError(f"unknown architecture {model_type!r} (known: {', '.join(ARCHITECTURES)})")
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
