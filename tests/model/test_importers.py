"""The checkpoint reader and the architecture table, on checkpoints written here with safetensors
alone (no transformers): names, layouts, shards, bfloat16, and every refusal."""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from attnx.cli import main
from attnx.errors import UsageError, WeightsError
from attnx.model import load_config, load_weights
from attnx.model.importers import ARCHITECTURES, import_weights, read_projection

rng = np.random.default_rng(7)


def _bert_tensors(layers: int = 2, width: int = 24, prefix: str = "bert.") -> dict[str, np.ndarray]:
    out = {}
    for n in range(layers):
        for part in ("self.query", "self.key", "self.value", "output.dense"):
            out[f"{prefix}encoder.layer.{n}.attention.{part}.weight"] = rng.standard_normal((width, width), np.float32)
            out[f"{prefix}encoder.layer.{n}.attention.{part}.bias"] = rng.standard_normal(width, np.float32)
    return out


def _checkpoint(folder, config: dict, tensors: dict[str, np.ndarray]) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return str(folder)


BERT = {"model_type": "bert", "hidden_size": 24, "num_attention_heads": 3}


def test_bert_layer_is_read_whatever_the_prefix(tmp_path):
    tensors = _bert_tensors()
    result = import_weights(_checkpoint(tmp_path / "bert", BERT, tensors), layer=1)
    c = result.config
    assert (c.d_model, c.n_heads, c.head_dim, c.key_padding_mask, c.causal, c.cross) == (24, 3, 8, True, False, False)
    np.testing.assert_array_equal(result.weights["q_proj.weight"], tensors["bert.encoder.layer.1.attention.self.query.weight"])
    np.testing.assert_array_equal(result.weights["out_proj.bias"], tensors["bert.encoder.layer.1.attention.output.dense.bias"])
    assert "q_proj.weight <- bert.encoder.layer.1.attention.self.query.weight" in result.mapping


def test_gpt2_conv1d_is_transposed_and_split(tmp_path):
    e = 24
    attn, proj = rng.standard_normal((e, 3 * e), np.float32), rng.standard_normal((e, e), np.float32)
    tensors = {"h.1.attn.c_attn.weight": attn, "h.1.attn.c_attn.bias": rng.standard_normal(3 * e, np.float32),
               "h.1.attn.c_proj.weight": proj, "h.1.attn.c_proj.bias": rng.standard_normal(e, np.float32)}  # fmt: skip
    config = {"model_type": "gpt2", "n_embd": e, "n_head": 4, "scale_attn_by_inverse_layer_idx": True}
    result = import_weights(_checkpoint(tmp_path / "g", config, tensors), layer=1)
    np.testing.assert_array_equal(result.weights["k_proj.weight"], attn[:, e : 2 * e].T)  # y = x W: W is [in, out]
    np.testing.assert_array_equal(result.weights["out_proj.weight"], proj.T)
    assert result.config.causal and result.config.scale == pytest.approx(1 / np.sqrt(6) / 2)  # layer 1: / (1 + 1)


def test_shards_and_bfloat16_are_read(tmp_path):
    tensors = _bert_tensors(prefix="")
    whole = import_weights(_checkpoint(tmp_path / "one", BERT, tensors), layer=1)
    sharded = tmp_path / "sharded"
    os.makedirs(sharded)
    (sharded / "config.json").write_text(json.dumps(BERT))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, sharded / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert all(np.array_equal(v, import_weights(str(sharded), layer=1).weights[k]) for k, v in whole.weights.items())
    # bfloat16, as most published checkpoints: widened by hand (numpy has no bfloat16), noted
    bf16 = tmp_path / "bf16"
    os.makedirs(bf16)
    (bf16 / "config.json").write_text(json.dumps(BERT))
    _write_bf16(bf16 / "model.safetensors", tensors)
    result = import_weights(str(bf16), layer=1)
    want = tensors["encoder.layer.1.attention.self.value.weight"]
    rounded = ((want.view(np.uint32) + 0x8000) >> 16 << 16).view(np.float32)  # what bf16 kept of each value
    np.testing.assert_allclose(result.weights["v_proj.weight"], rounded, rtol=2**-8)
    assert any("BF16 converted to float32" in n for n in result.notes)


def _write_bf16(path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        raw = ((array.astype(np.float32).view(np.uint32) + 0x8000) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


@pytest.mark.parametrize(
    ("config", "tensors", "kwargs", "error", "message"),
    [({"model_type": "electra"}, {}, {}, UsageError, "unknown architecture 'electra' (known: bert"),
     ({"model_type": "deepseek_v32"}, {}, {}, UsageError, "index_topk keys its lightning indexer scores highest"),
     ({"model_type": "llama", "quantization_config": {"quant_method": "gptq", "bits": 4}}, {}, {}, UsageError,
      "its weights are quantized (quantization_config: quant_method 'gptq'): attnx imports float weights"),
     ({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8", "fmt": "e5m2",
                                                            "weight_block_size": [128, 128]}},
      {}, {}, UsageError, "quant_method 'fp8', blocks of 128x128): attnx imports float weights"),
     ({"model_type": "longcat_flash"}, {}, {}, UsageError, "scales q by sqrt(hidden_size / q_lora_rank)"),
     ({"model_type": "falcon", "alibi": True}, {}, {}, UsageError, "falcon with alibi: transformers' Falcon adds its "
      "ALiBi bias before the scale"),
     ({"model_type": "mpt", "attn_config": {"qk_ln": True}}, {}, {}, UsageError, "qk_ln True: a LayerNorm of q and k"),
     ({"model_type": "mpt", "attn_config": {"clip_qkv": 6.0}}, {}, {}, UsageError, "clip_qkv 6.0: q, k and v clamped"),
     ({"model_type": "mpt", "attn_config": {"alibi": False}}, {}, {}, UsageError, "alibi False: MPT's own code"),
     ({"model_type": "mpt", "attn_config": {"alibi_bias_max": 16}}, {}, {}, UsageError, "always builds its slopes "
      "with 8"),
     ({"model_type": "mpt", "attn_config": {"attn_type": "multiquery_attention"}}, {}, {}, UsageError, "multi-query"),
     ({"model_type": "mpt", "attn_config": {"prefix_lm": True}}, {}, {}, UsageError, "bidirectional attention over a "
      "prefix"),
     ({"model_type": "mpt", "no_bias": False}, {}, {}, UsageError, "mpt with no_bias false"),
     ({"model_type": "bloom", "n_layer": 2}, {}, {"layer": 5}, UsageError, "bloom has 2 layers: no layer 5"),
     ({"model_type": "bloom", "n_embed": 30, "n_head": 4}, {}, {}, UsageError, "hidden size 30 is not divisible by 4"),
     ({"model_type": "mpt"}, {}, {"attention": "cross"}, UsageError, "decoder self-attention only"),
     ({"model_type": "gemma3"}, {}, {}, UsageError, "a gemma3_text checkpoint"),
     ({"model_type": "kimi_k25"}, {}, {}, UsageError, "is Kimi K2.5's multimodal checkpoint"),
     ({"model_type": "llama", "num_hidden_layers": 2}, {}, {"layer": 5}, UsageError, "llama has 2 layers: no layer 5"),
     ({"model_type": "qwen2"}, {}, {"attention": "cross"}, UsageError, "decoder self-attention only"),
     ({"model_type": "t5", "d_model": 24, "num_heads": 3, "d_kv": 8}, {}, {}, UsageError, "relative position bias"),
     ({**BERT, "position_embedding_type": "relative_key"}, {}, {}, UsageError, "relative position terms"),
     (BERT, {}, {"attention": "cross"}, UsageError, "bert has no cross-attention"),
     (BERT, {}, {"layer": 5}, UsageError, "bert has no encoder layer 5"),
     ({**BERT, "hidden_size": 32}, {}, {}, WeightsError, "'q_proj.weight' has shape [24, 24], expected [24, 32]"),
     ({**BERT, "num_attention_heads": 0}, {}, {}, UsageError, "'num_attention_heads' must be a positive integer")],
)  # fmt: skip
def test_what_cannot_be_imported_is_refused_by_name(tmp_path, config, tensors, kwargs, error, message):
    folder = _checkpoint(tmp_path / "ckpt", config, tensors or _bert_tensors(prefix=""))
    with pytest.raises(error, match=re.escape(message)):
        import_weights(folder, **kwargs)


def test_a_missing_tensor_and_a_pickle_checkpoint_are_refused(tmp_path):
    tensors = _bert_tensors(prefix="")
    del tensors["encoder.layer.1.attention.self.key.bias"]
    folder = _checkpoint(tmp_path / "ckpt", BERT, tensors)
    with pytest.raises(WeightsError, match="has no tensor 'encoder.layer.1.attention.self.key.bias'"):
        import_weights(folder, layer=1)
    pickles = tmp_path / "pickles"
    os.makedirs(pickles)
    (pickles / "config.json").write_text(json.dumps(BERT))
    (pickles / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    with pytest.raises(WeightsError, match=r"only as pickles \(pytorch_model.bin\): refused, never unpickled"):
        import_weights(str(pickles))


def test_cli_writes_the_attnx_folder_and_replaces_only_an_import(tmp_path, capsys):
    tensors = _bert_tensors(prefix="")
    folder = _checkpoint(tmp_path / "ckpt", BERT, tensors)
    out = tmp_path / "imported"
    assert main(["import", folder, "--layer", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "k_proj.weight <- encoder.layer.1.attention.self.key.weight" in printed and f"wrote {out}" in printed
    config = load_config(out / "config.json")
    weights = load_weights(out / "weights.safetensors", config)
    np.testing.assert_array_equal(weights["v_proj.bias"], tensors["encoder.layer.1.attention.self.value.bias"])
    assert main(["import", folder, "--out", str(out)]) == 2  # exists
    assert "already exists" in capsys.readouterr().err
    assert main(["import", folder, "--out", str(out), "--force", "--key-padding-mask", "no"]) == 0
    assert load_config(out / "config.json").key_padding_mask is False
    (out / "mine.txt").write_text("keep")
    assert main(["import", folder, "--out", str(out), "--force"]) == 2
    assert "holds files an import does not write (mine.txt)" in capsys.readouterr().err and (out / "mine.txt").exists()


def test_the_table_declares_every_family_the_readme_lists():
    assert set(ARCHITECTURES) == {"bert", "roberta", "vit", "gpt2", "bart", "whisper", "t5"}
    assert {k for k in ARCHITECTURES["whisper"]} == {("encoder", "self"), ("decoder", "self"), ("decoder", "cross")}


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3"])
def test_read_projection_reads_one_tensor_alone_as_the_import_gives_it(family, monkeypatch):
    """A rotary decoder's projection read by itself (Phi-3's q, k, v: their rows of its fused q|k|v), equal to the
    import's, and of it only the rows asked for; a BERT checkpoint's through the import of its layer."""
    from attnx.model import checkpoint, importers

    folder = os.path.join(os.path.dirname(__file__), "..", "fixtures", "genai", family, "checkpoint")
    read: list[str] = []
    real = checkpoint.read_tensor
    monkeypatch.setattr(checkpoint, "read_tensor", lambda path, name, *a: (read.append(name), real(path, name, *a))[1])
    weights = import_weights(folder, layer=1).weights
    for role, name in importers.PROJECTIONS.items():
        read.clear()
        weight = read_projection(folder, 1, role)
        tensor = "qkv" if family == "phi3" and role != "o" else role
        assert read == [f"model.layers.1.self_attn.{tensor}_proj.weight"]
        assert np.array_equal(weight, weights[name])
        assert np.array_equal(read_projection(folder, 1, role, rows=[5, 0, 9]), weights[name][[5, 0, 9]])


def test_read_projection_of_another_architecture_imports_its_layer(tmp_path):
    folder = _checkpoint(tmp_path / "bert", BERT, _bert_tensors())
    weights = import_weights(folder, layer=1).weights
    assert np.array_equal(read_projection(folder, 1, "q"), weights["q_proj.weight"])
    assert np.array_equal(read_projection(folder, 1, "o", rows=[3, 1]), weights["out_proj.weight"][[3, 1]])

