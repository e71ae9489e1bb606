"""The speed model of measurements/optimize_speed (a Llama shape: hidden 1024, 16 heads of 64, 4 kv heads, 4 layers,
intermediate 2816, vocab 4096, random weights, torch seed 0), with a word-level tokenizer over its whole vocabulary,
exported and packaged for the serve_load benchmark:

    .venv/bin/python measurements/serve_load/make.py WORK

writes WORK/checkpoint (safetensors, config.json, a tokenizer.json mapping "t3".."t4095" to ids 3..4095 one to one,
"<pad>", "<s>", "</s>" at 0-2), WORK/export/model.onnx (torch.onnx dynamo, sdpa, with its cache, as
tests/fixtures/exported/make.py exports), and the two packages: WORK/pkg-fp32 (`attnx build --model EXPORT
--checkpoint CKPT`) and WORK/pkg-int4 (the same with `--weights int4`). Each step is skipped when its output is there.
The GGUF files are make_gguf.py's (llama-cpp-python's venv).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=4,
              intermediate_size=2816, vocab_size=4096, max_position_embeddings=16384)  # fmt: skip


def load_script(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def make_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    """A word-level tokenizer over the whole vocabulary, split on whitespace: the text "t5 t17" is ids [5, 17]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with a space
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")  # fmt: skip
    fast.model_max_length = max_length
    fast.save_pretrained(out)


def make(work: Path) -> dict[str, Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt, export = work / "checkpoint", work / "export" / "model.onnx"
    if not (ckpt / "model.safetensors").exists():
        torch.manual_seed(0)  # as measurements/optimize_speed/run.py's make(): the same weights
        LlamaForCausalLM(LlamaConfig(**CONFIG)).eval().save_pretrained(ckpt)
    if not (ckpt / "tokenizer.json").exists():
        make_tokenizer(ckpt, CONFIG["vocab_size"], CONFIG["max_position_embeddings"])
    if not export.exists():
        load_script("fixtures_make", ROOT / "tests/fixtures/exported/make.py").export_decoder(ckpt, "sdpa", None, export)
    packages = {"fp32": work / "pkg-fp32", "int4": work / "pkg-int4"}
    for name, pkg in packages.items():
        if (pkg / "manifest.json").exists():
            continue
        command = [str(Path(sys.executable).parent / "attnx"), "build", "--model", str(export), "--checkpoint",
                   str(ckpt), "--out", str(pkg), "--force"] + (["--weights", "int4"] if name == "int4" else [])  # fmt: skip
        print(" ".join(command), flush=True)
        start = time.perf_counter()
        subprocess.run(command, check=True)
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    return {"checkpoint": ckpt, "export": export} | packages


if __name__ == "__main__":
    for key, path in make(Path(sys.argv[1])).items():
        print(key, path)
