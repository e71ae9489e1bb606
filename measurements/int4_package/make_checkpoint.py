"""A Qwen2.5-0.5B-shaped checkpoint with random weights: hidden 896, 14 heads of 64 over 2 kv heads, intermediate 4864,
q/k/v biases, tied embeddings, rope theta 1e6, vocab 151936 (Qwen2.5's) and 24 layers by default. Each layer's q and k
projections are scaled by 4 (sharper attention than Gaussian weights give); a 256-word WordLevel tokenizer goes beside it
(the builder wants one; the measurements feed token ids). Run it with a Python that has torch and transformers 5 (the
ONNX Runtime GenAI venv):

    GENAI_PY measurements/int4_package/make_checkpoint.py OUT [--layers 24] [--vocab 151936]
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args()

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    out = Path(args.out)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=args.layers, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, sliding_window=None,
                         use_sliding_window=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():  # the zero-initialised biases and norms get some spread
            if param.numel() > 1 and float(param.std()) == 0.0:
                param.add_(0.1 * torch.randn_like(param))
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")  # fmt: skip
    fast.model_max_length = 32768
    fast.save_pretrained(out)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
