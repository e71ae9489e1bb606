"""The checkpoint of make_checkpoint.py as a GGUF file for llama.cpp (architecture qwen2), f32, then Q4_0 through
llama.cpp's own quantizer (llama_model_quantize, as its `llama-quantize` tool). Run in a venv with llama-cpp-python
(built from its source distribution) and the gguf package:

    LLAMA_PY make_gguf.py CKPT OUT_DIR        # writes OUT_DIR/model-f32.gguf and OUT_DIR/model-q4_0.gguf

llama.cpp's own converter (convert_hf_to_gguf.py) reads the vocabulary through the checkpoint's tokenizer and
refuses the checkpoint's 256-word WordLevel one (its BPE pre-tokenizer check); token ids are all these measurements
feed, so the GGUF carries a placeholder SentencePiece-style vocabulary of the model's size ("<unk>", "<s>", "</s>",
then "t3", "t4", ...) and the tensors under llama.cpp's qwen2 names, as the converter writes them: each HF weight
[out, in] as it is (qwen2's rope is NEOX-style: q and k are not permuted), the q/k/v biases, the tied head left out
(llama.cpp then reads token_embd for the output).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np

NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
         "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
         "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
         "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}  # fmt: skip


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
        assert entry["dtype"] == "F32", (name, entry["dtype"])
        start, end = entry["data_offsets"]
        out[name] = data[start:end].view(np.float32).reshape(entry["shape"])
    return out


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


def write_f32(ckpt: Path, out: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    tensors = safetensors(ckpt / "model.safetensors")
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name("attnx int4_package checkpoint")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(float(config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta")))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = config["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (vocab - 3))  # fmt: skip
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    tied = config.get("tie_word_embeddings", False)
    for name, array in tensors.items():
        target = gguf_name(name)
        if target is None or (tied and target == "output.weight"):
            continue
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
