"""A whole decoder at Llama-3-8B's width, as ONNX Runtime GenAI's model builder writes one (the graph of
tests/fixtures/genai/llama/fp32/model.onnx: packed qkv MatMul, GroupQueryAttention with its own rotary from
cos/sin caches, SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, the SiLU MLP, past/present per
layer), with random weights, whose data file is larger than this machine's memory: written tensor by tensor,
never more than one tensor held at once (the largest: the embedding and lm_head, 2.1 GB each).

    python measurements/audit_scale/make_model.py --out /tmp/scale-llama3-8b [--checkpoint /tmp/scale-ckpt]

--checkpoint also writes a Hugging Face-style checkpoint of the same attention weights (config.json, one
safetensors file per layer and model.safetensors.index.json; the attention tensors only, which is what
`attnx audit --checkpoint` reads): q/k/v/o as torch Linear stores them ([out, in]), the graph's packed
qkv the transpose of q|k|v. The builder itself cannot make a model this size here (it loads the whole
checkpoint), and attnx does not import the builder (tests/fixtures/genai/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import onnx
from onnx import TensorProto, helper
from safetensors.numpy import save_file

# meta-llama/Meta-Llama-3-8B's config.json (rope_scaling null: Llama 3.0; 3.1 adds the llama3 scaling)
LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32, "rope_theta": 500000.0,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}  # fmt: skip
MS = "com.microsoft"


class DataFile:
    """model.onnx.data, appended one tensor at a time; each tensor's TensorProto points at its bytes."""

    def __init__(self, path: str, location: str) -> None:
        self.path, self.location, self.file, self.offset = path, location, open(path, "wb"), 0

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        array = np.ascontiguousarray(array, np.float32)
        self.file.write(array.data)
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.location), ("offset", str(self.offset)),
                           ("length", str(array.nbytes))):  # fmt: skip
            tensor.external_data.add(key=key, value=value)
        self.offset += array.nbytes
        return tensor


def uniform(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> np.ndarray:
    """Random float32 of standard deviation 1/sqrt(fan_in) (uniform: the fastest numpy draws here)."""
    a = rng.random(shape, dtype=np.float32)
    a -= 0.5
    a *= np.float32(math.sqrt(12.0 / fan_in))
    return a


def rope_caches(cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_position_embeddings, head_dim / 2] as the builder computes them (make_rotary_embedding_caches:
    torch float32 inv_freq and positions, their outer product, cos and sin), in numpy float32."""
    dim = cfg["head_dim"]
    inv_freq = (1.0 / (np.float32(cfg["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32)
                                                          / np.float32(dim)))).astype(np.float32)  # fmt: skip
    angles = np.outer(np.arange(cfg["max_position_embeddings"], dtype=np.float32), inv_freq).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def build(out: str, cfg: dict, checkpoint: str | None, seed: int, say=print) -> dict:
    os.makedirs(out, exist_ok=True)
    d, nh, nkv, hd, ff, vocab, layers = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                          "head_dim", "intermediate_size", "vocab_size",
                                                          "num_hidden_layers"))  # fmt: skip
    q_out, kv_out = nh * hd, nkv * hd
    rng = np.random.Generator(np.random.PCG64(seed))
    data = DataFile(os.path.join(out, "model.onnx.data.partial"), "model.onnx.data")  # renamed when whole
    inits, nodes, infos = [], [], []
    F, I64, I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    BS = ["batch_size", "sequence_length"]

    def info(name: str, elem: int, shape: list) -> str:
        infos.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def node(op: str, name: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> None:
        nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))

    def weight(name: str, array: np.ndarray) -> str:
        inits.append(data.add(name, array))
        return name

    inputs = [helper.make_tensor_value_info("input_ids", I64, BS),
              helper.make_tensor_value_info("attention_mask", I64, ["batch_size", "total_sequence_length"])]  # fmt: skip
    outputs = [helper.make_tensor_value_info("logits", F, [*BS, vocab])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", F,
                                                        ["batch_size", nkv, "past_sequence_length", hd]))  # fmt: skip
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", F,
                                                         ["batch_size", nkv, "total_sequence_length", hd]))  # fmt: skip
    # the attention mask as GroupQueryAttention takes it: seqlens_k = sum(mask) - 1, total_sequence_length
    m = "/model/attn_mask_reformat/attn_mask_subgraph"
    one, one_1d = "/model/constants/INT64/1", "/model/constants/INT64/[1]"
    nodes.append(helper.make_node("Constant", [], [one_1d], name="/model/constant_nodes/INT64/[1]",
                                  value=helper.make_tensor("v", I64, [1], [1])))  # fmt: skip
    nodes.append(helper.make_node("Constant", [], [one], name="/model/constant_nodes/INT64/1",
                                  value=helper.make_tensor("v", I64, [], [1])))  # fmt: skip
    node("ReduceSum", f"{m}/ReduceSum", ["attention_mask", one_1d], [info(f"{m}/ReduceSum/output_0", I64, ["batch_size"])],
         keepdims=0)  # fmt: skip
    node("Sub", f"{m}/Sub", [f"{m}/ReduceSum/output_0", one_1d], [info(f"{m}/Sub/output_0", I64, ["batch_size"])])
    seqlens = info(f"{m}/Sub/Cast/output_0", I32, ["batch_size"])
    node("Cast", f"{m}/Sub/Cast", [f"{m}/Sub/output_0"], [seqlens], to=I32)
    node("Shape", f"{m}/Shape", ["attention_mask"], [info(f"{m}/Shape/output_0", I64, [2])])
    node("Gather", f"{m}/Gather", [f"{m}/Shape/output_0", one], [info(f"{m}/Gather/output_0", I64, [])], axis=0)
    total = info(f"{m}/Gather/Cast/output_0", I32, [])
    node("Cast", f"{m}/Gather/Cast", [f"{m}/Gather/output_0"], [total], to=I32)

    started = time.time()
    embed = weight("model.embed_tokens.weight", uniform(rng, (vocab, d), d))
    hidden = info("/model/embed_tokens/Gather/output_0", F, [*BS, d])
    node("Gather", "/model/embed_tokens/Gather", [embed, "input_ids"], [hidden])
    cos, sin = rope_caches(cfg)
    norm_weight = lambda name: weight(name, 1.0 + 0.1 * rng.standard_normal(d, dtype=np.float32))  # noqa: E731
    eps = float(cfg["rms_norm_eps"])
    weight_map: dict[str, str] = {}
    residual, mlp_out = None, ""
    for i in range(layers):
        p, w = f"/model/layers.{i}", f"model.layers.{i}"
        x = info(f"{p}/input_layernorm/output_0", F, [*BS, d])
        if residual is None:
            node("SimplifiedLayerNormalization", f"{p}/input_layernorm/LayerNorm",
                 [hidden, norm_weight(f"{w}.input_layernorm.weight")], [x], axis=-1, epsilon=eps, stash_type=1)  # fmt: skip
            residual = hidden
        else:
            summed = info(f"{p}/input_layernorm/output_3", F, [*BS, d])
            node("SkipSimplifiedLayerNormalization", f"{p}/input_layernorm/SkipLayerNorm",
                 [residual, mlp_out, norm_weight(f"{w}.input_layernorm.weight")], [x, "", "", summed], MS,
                 epsilon=eps)  # fmt: skip
            residual = summed
        # the attention's weights as torch Linear keeps them ([out, in]); the graph's packed qkv is [in, q|k|v]
        q, k, v = uniform(rng, (q_out, d), d), uniform(rng, (kv_out, d), d), uniform(rng, (kv_out, d), d)
        o = uniform(rng, (d, q_out), q_out)
        qkv = weight(f"{w}.attn.qkv_proj.MatMul.weight", np.concatenate([q.T, k.T, v.T], axis=1))
        if checkpoint is not None:
            shard = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
            tensors = {f"model.layers.{i}.self_attn.{n}_proj.weight": t for n, t in zip("qkvo", (q, k, v, o))}
            save_file(tensors, os.path.join(checkpoint, shard))
            weight_map.update({name: shard for name in tensors})
        packed = info(f"{p}/attn/qkv_proj/MatMul/output_0", F, [*BS, q_out + 2 * kv_out])
        node("MatMul", f"{p}/attn/qkv_proj/MatMul", [x, qkv], [packed])
        if i == 0:
            weight("cos_cache", cos)
            weight("sin_cache", sin)
        core = info(f"{p}/attn/GroupQueryAttention/output_0", F, [*BS, q_out])
        node("GroupQueryAttention", f"{p}/attn/GroupQueryAttention",
             [packed, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens, total, "cos_cache",
              "sin_cache", "", "", ""], [core, f"present.{i}.key", f"present.{i}.value"], MS,
             num_heads=nh, kv_num_heads=nkv, scale=1.0 / math.sqrt(hd), local_window_size=-1, softcap=0.0,
             do_rotary=1, rotary_interleaved=0)  # fmt: skip
        attn = info(f"{p}/attn/o_proj/MatMul/output_0", F, [*BS, d])
        node("MatMul", f"{p}/attn/o_proj/MatMul", [core, weight(f"{w}.attn.o_proj.MatMul.weight", o.T)], [attn])
        del q, k, v, o
        post, summed = info(f"{p}/post_attention_layernorm/output_0", F, [*BS, d]), \
            info(f"{p}/post_attention_layernorm/output_3", F, [*BS, d])  # fmt: skip
        node("SkipSimplifiedLayerNormalization", f"{p}/post_attention_layernorm/SkipLayerNorm",
             [residual, attn, norm_weight(f"{w}.post_attention_layernorm.weight")], [post, "", "", summed], MS,
             epsilon=eps)  # fmt: skip
        residual = summed
        gate, up = info(f"{p}/mlp/gate_proj/MatMul/output_0", F, [*BS, ff]), info(f"{p}/mlp/up_proj/MatMul/output_0", F, [*BS, ff])
        node("MatMul", f"{p}/mlp/gate_proj/MatMul", [post, weight(f"{w}.mlp.gate_proj.MatMul.weight", uniform(rng, (d, ff), d))], [gate])
        node("MatMul", f"{p}/mlp/up_proj/MatMul", [post, weight(f"{w}.mlp.up_proj.MatMul.weight", uniform(rng, (d, ff), d))], [up])
        sig, act, prod = (info(f"{p}/mlp/{n}/output_0", F, [*BS, ff]) for n in ("act_fn/Sigmoid", "act_fn/Mul", "Mul"))
        node("Sigmoid", f"{p}/mlp/act_fn/Sigmoid", [gate], [sig])
        node("Mul", f"{p}/mlp/act_fn/Mul", [gate, sig], [act])
        node("Mul", f"{p}/mlp/Mul", [act, up], [prod])
        mlp_out = info(f"{p}/mlp/down_proj/MatMul/output_0", F, [*BS, d])
        node("MatMul", f"{p}/mlp/down_proj/MatMul", [prod, weight(f"{w}.mlp.down_proj.MatMul.weight", uniform(rng, (ff, d), ff))],
             [mlp_out])  # fmt: skip
        say(f"layer {i}: {data.offset / 1e9:.1f} GB written, {time.time() - started:.0f} s")
    p = f"/model/layers.{layers}"
    final = info(f"{p}/final_norm_layernorm/output_0", F, [*BS, d])
    node("SkipSimplifiedLayerNormalization", f"{p}/final_norm_layernorm/SkipLayerNorm",
         [residual, mlp_out, norm_weight(f"model.layers.{layers}.final_norm_layernorm.weight")], [final], MS,
         epsilon=eps)  # fmt: skip
    node("MatMul", "/lm_head/MatMul", [final, weight("lm_head.MatMul.weight", uniform(rng, (d, vocab), d))], ["logits"])
    data.file.close()
    graph = helper.make_graph(nodes, "main_graph", inputs, outputs, initializer=inits, value_info=infos)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid(MS, 1)],
                              ir_version=10, producer_name="measurements/audit_scale/make_model.py")  # fmt: skip
    partial = os.path.join(out, "model.onnx.partial")
    onnx.save_model(model, partial)  # the graph alone: its tensors already point into model.onnx.data
    os.replace(data.path, os.path.join(out, "model.onnx.data"))
    os.replace(partial, os.path.join(out, "model.onnx"))
    if checkpoint is not None:
        hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
              "rope_scaling": None, "tie_word_embeddings": False, **cfg}  # fmt: skip
        with open(os.path.join(checkpoint, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        with open(os.path.join(checkpoint, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    layer_bytes = 4 * (d * (q_out + 2 * kv_out) + q_out * d + 3 * d * ff + 2 * d)
    attention_bytes = 4 * (d * (q_out + 2 * kv_out) + q_out * d)
    return {"out": out, "data_bytes": os.path.getsize(os.path.join(out, "model.onnx.data")),
            "layer_bytes": layer_bytes, "attention_bytes": attention_bytes, "layers": layers,
            "seconds": round(time.time() - started, 1), "config": cfg, "seed": seed,
            "checkpoint": checkpoint}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder of model.onnx and model.onnx.data")
    ap.add_argument("--checkpoint", default=None, help="also write the attention weights as a checkpoint here")
    ap.add_argument("--layers", type=int, default=LLAMA3_8B["num_hidden_layers"])
    ap.add_argument("--vocab", type=int, default=LLAMA3_8B["vocab_size"], help="a smaller one for a quick try")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write what was made (sizes, seconds) here")
    args = ap.parse_args()
    if args.checkpoint:
        os.makedirs(args.checkpoint, exist_ok=True)
    result = build(args.out, {**LLAMA3_8B, "num_hidden_layers": args.layers, "vocab_size": args.vocab}, args.checkpoint, args.seed)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
