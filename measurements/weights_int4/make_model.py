"""A Llama 3.2-style checkpoint with random weights (llama3 rope, factor 32, original 8192; 155M parameters, tied
embeddings, q and k projections x3 so attention is peaked) in ./ck, and its torch.onnx dynamo export with the cache in
./export/model.onnx (the fixtures' export_decoder). Run from the folder to write into:

    cd /tmp/real && python /work/main/measurements/weights_int4/make_model.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
sys.path[:0] = [str(FIXTURES / "exported"), str(FIXTURES)]
import make  # noqa: E402 - the fixtures' export script, found through the path above


def main() -> None:
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                      num_hidden_layers=8, intermediate_size=2816, vocab_size=32000, max_position_embeddings=131072,
                      tie_word_embeddings=True, rope_parameters=rope, initializer_range=0.05)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # peaked attention, as trained models have
            layer.self_attn.q_proj.weight.mul_(3)
            layer.self_attn.k_proj.weight.mul_(3)
    model.save_pretrained("ck")
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters")
    start = time.time()
    make.export_decoder(Path("ck"), "sdpa", 20, Path("export/model.onnx"))
    print(f"exported in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
