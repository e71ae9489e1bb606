"""A checkpoint folder read without torch: its config.json, and its tensors from *.safetensors (sharded included) by
their byte ranges, only those asked for (and of a matrix only the rows asked for). A pickle (pytorch_model.bin) is
refused, never unpickled."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnx.errors import UsageError, WeightsError

__all__ = ["Checkpoint", "MAX_HEADER_BYTES", "checkpoint_files", "fp8_blocks", "read_checkpoint_config", "read_tensor",
           "weight_files"]

MAX_HEADER_BYTES = 100 * 1024**2  # a safetensors header past this is not one


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


def weight_files(folder: str) -> dict[str, str]:
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
    model.safetensors, or the sharded index and every shard it names (plain names, weight_files' rule)."""
    read_checkpoint_config(folder)
    index = "model.safetensors.index.json"
    shards = sorted({os.path.basename(p) for p in weight_files(folder).values()})
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


# numpy types of the safetensors dtypes a weight may have (BF16 is widened by hand: numpy has none; F8_E4M3 read
# through ml_dtypes' float8_e4m3fn, and scaled by its blocks' weight_scale_inv: Checkpoint.get).
_SAFETENSORS_TYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8}


def fp8_blocks(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The [rows, columns] of the FP8 blocks each weight_scale_inv entry scales (DeepSeek-V3's and Kimi K2's
    published weights: quantization_config quant_method fp8, fmt e4m3, weight_block_size), or None: not that scheme."""
    q = config.get("quantization_config")
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        return None
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return None
    return block[0], block[1]


def read_tensor(path: str, name: str, entry: Mapping[str, Any], converted: set[str],
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
    if dtype == "F8_E4M3":  # exact in float32; its scale applied by the caller (Checkpoint.get)
        import ml_dtypes

        array = array.view(ml_dtypes.float8_e4m3fn)
    if dtype != "F32":
        converted.add(dtype)
    return np.array(array, dtype=np.float32).reshape(shape)


class Checkpoint:
    """The tensors of a checkpoint folder by name; a name is found whatever prefix the saving
    class put before it ("bert.", "model.", "transformer.")."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.files = weight_files(folder)
        self.headers: dict[str, dict[str, Any]] = {}
        self.converted: set[str] = set()
        self.fp8_blocks = fp8_blocks(read_checkpoint_config(folder))

    def find(self, name: str) -> str | None:
        hits = [k for k in self.files if k == name or k.endswith("." + name)]
        if len(hits) > 1:
            raise WeightsError(f"{self.folder!r}: tensor {name!r} is ambiguous ({', '.join(sorted(hits)[:3])})")
        return hits[0] if hits else None

    def shape(self, name: str) -> tuple[str, Any]:
        """(its key, its shape as the header gives it) of tensor `name`, from the header alone."""
        key = self.find(name)
        if key is None:
            raise WeightsError(f"{self.folder!r} has no tensor {name!r}: not the layer or architecture it claims")
        path = self.files[key]
        self.headers.setdefault(path, _header(path))
        return key, self.headers[path].get(key, {}).get("shape")

    def get(self, name: str, rows: Sequence[int] | None = None) -> tuple[str, np.ndarray]:
        """(its key, the tensor) of `name`; rows: only those rows of a matrix (read_tensor)."""
        key = self.find(name)
        if key is None:
            raise WeightsError(f"{self.folder!r} has no tensor {name!r}: not the layer or architecture it claims")
        path = self.files[key]
        if path not in self.headers:
            self.headers[path] = _header(path)
        if key not in self.headers[path]:
            raise WeightsError(f"{os.path.basename(path)} has no tensor {key!r}, which its index names")
        entry = self.headers[path][key]
        if entry.get("dtype") != "F8_E4M3":
            return key, read_tensor(path, key, entry, self.converted, rows)
        return key, self._fp8(path, key, entry, rows)

    def _fp8(self, path: str, key: str, entry: Mapping[str, Any], rows: Sequence[int] | None) -> np.ndarray:
        """An FP8 weight times its blocks' scales (`key`_scale_inv, float32 [ceil(rows / b0), ceil(cols / b1)]), in
        float64 and rounded once to float32, as the block quantization defines it."""
        if self.fp8_blocks is None:
            raise WeightsError(f"{os.path.basename(path)}: tensor {key!r} is F8_E4M3, and config.json states no fp8 "
                               "block quantization (quantization_config: quant_method fp8, weight_block_size)")  # fmt: skip
        weight = read_tensor(path, key, entry, self.converted)
        if weight.ndim != 2:
            raise WeightsError(f"{os.path.basename(path)}: tensor {key!r} is F8_E4M3 of {weight.ndim} dims, not a matrix")
        _, scale = self.get(f"{key}_scale_inv")
        (b0, b1), (n, k) = self.fp8_blocks, weight.shape
        if scale.shape != (-(-n // b0), -(-k // b1)):
            raise WeightsError(f"{key}_scale_inv has shape {list(scale.shape)}, expected {[-(-n // b0), -(-k // b1)]} "
                               f"for {key} [{n}, {k}] in blocks of {b0}x{b1}")  # fmt: skip
        full = np.repeat(np.repeat(scale.astype(np.float64), b0, axis=0)[:n], b1, axis=1)[:, :k]
        dequantized = (weight.astype(np.float64) * full).astype(np.float32)
        return dequantized if rows is None else dequantized[list(rows)]
