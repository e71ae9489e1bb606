"""make.py's checkpoint as GGUF files for llama.cpp (architecture llama): f32, then Q4_0 through llama.cpp's own
quantizer (llama_model_quantize, as its `llama-quantize` tool). Run in llama-cpp-python's venv (built from its source
distribution), with the gguf package:

    LLAMA_PY measurements/serve_load/make_gguf.py CKPT OUT_DIR   # OUT_DIR/model-f32.gguf and OUT_DIR/model-q4_0.gguf

Adapted from measurements/int4_package/make_gguf.py (qwen2). llama.cpp's converter (convert_hf_to_gguf.py) reads
the vocabulary through the checkpoint's tokenizer and accepts no word-level one, so this writes the GGUF itself:
the tensors under llama.cpp's llama names, as the converter's LlamaModel writes them (each HF weight [out, in] as it
is, q and k permuted by its `permute`: llama.cpp's llama rope is the interleaved one, transformers' the rotate-half
one), and a vocabulary that tokenizes as make.py's tokenizer does: llama.cpp's "whitespace" tokenizer (text split on
whitespace, each word a BPE word) over the tokens "<pad>", "<s>", "</s>", "t3" .. "t4095", with the merges that build
"t" + digits left to right ("t 1", "t1 2", ...), so the text "t5 t17" is ids [5, 17] in both. No BOS is added;
"</s>" (2) is the end of sequence, as in the checkpoint's config.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np

NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight"}  # fmt: skip


def safetensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's float32 tensors, read by its header (no torch, nothing executed)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    data = np.memmap(path, np.uint8, "r", offset=8 + n)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] != "F32":
            raise SystemExit(f"{path}: {name} is {entry['dtype']}, not F32")
        start, end = entry["data_offsets"]
        out[name] = data[start:end].view(np.float32).reshape(entry["shape"])
    return out


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs (i, i + d/2) to interleaved (2i, 2i + 1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{NAMES['.'.join(parts[3:])]}"
    return None


def vocabulary(size: int) -> tuple[list[str], list[str]]:
    tokens = ["<pad>", "<s>", "</s>"] + [f"t{i}" for i in range(3, size)]
    merges = [f"t{i // 10 if i >= 10 else ''} {i % 10}" for i in range(1, size)]
    return tokens, merges


def write_f32(ckpt: Path, out: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    tensors = safetensors(ckpt / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("attnx serve_load speed model")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(config["hidden_size"] // heads)
    w.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, merges = vocabulary(config["vocab_size"])
    w.add_tokenizer_model("whitespace")
    w.add_tokenizer_pre("whitespace")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    tied = config.get("tie_word_embeddings", False)
    for name, array in tensors.items():
        target = gguf_name(name)
        if target is None or (tied and target == "output.weight"):
            continue
        if target.endswith("attn_q.weight"):
            array = permute(array, heads)
        elif target.endswith("attn_k.weight"):
            array = permute(array, kv_heads)
        w.add_tensor(target, np.ascontiguousarray(array, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(f32: Path, out: Path) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize failed: {rc}")


def main() -> int:
    ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    write_f32(ckpt, out / "model-f32.gguf")
    quantize(out / "model-f32.gguf", out / "model-q4_0.gguf")
    for f in ("model-f32.gguf", "model-q4_0.gguf"):
        print(f, (out / f).stat().st_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
