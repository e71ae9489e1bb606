"""attnx bench --decode: the step's bytes, the bound, and the report (numbers are for the note, not here)."""

from __future__ import annotations

import json

import pytest

from attnx.bench import step_bytes
from attnx.cli import main
from attnx.model import AttentionConfig, preset
from attnx.runtimes.base import backend_unavailable_reason

# the slow tier: benchmark runs
pytestmark = pytest.mark.slow


def test_step_bytes_counts_weights_cache_and_new_token():
    c = AttentionConfig(d_model=1024, n_heads=16, n_kv_heads=4, causal=True, kv_cache=True)
    row = 4 * 4 * (64 + 64)  # one position of the cache: 4 kv heads, keys and values, fp32
    assert step_bytes(c, 2048) == 4 * c.n_params + row * 2049 + row + 2 * 1024 * 4
    large = preset("large")
    # MHA moves 4x the cache bytes of GQA with a quarter of the kv heads (and more weights)
    assert step_bytes(large, 8192) - 4 * large.n_params == 4 * (step_bytes(c, 8192) - 4 * c.n_params) - 3 * 2 * 1024 * 4


def test_cli_bench_decode(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["bench", "--preset", "tiny", "--decode", "--past", "8,32", "--kv-heads", "2", "--repeat", "2",
                 "--threads", "1", "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "2 kv heads" in text and "ort-fused buffer" in text and "torch eager" in text
    data = json.loads(out.read_text())
    openvino_runs = backend_unavailable_reason("openvino") is None
    assert data["config"]["n_kv_heads"] == 2 and data["config"]["kv_cache"] and data["machine"]["cpu"]
    assert [r["past"] for r in data["rows"]] == [8, 32]
    for r in data["rows"]:
        assert abs(r["bound_ms"] - r["step_bytes"] / (r["bandwidth_gbs"] * 1e9) * 1e3) < 1e-9
        assert r["bandwidth_gbs"] == max(r["copies_gbs"].values())
        impls = {k.rsplit(" ", 1)[0] for k in r["times_ms"]}
        ov = {"openvino onnx growing", "openvino decomposed growing"} if openvino_runs else set()
        assert impls == {"ort-fused buffer", "ort-fused buffer grouped-mha", "ort-fused buffer switch", "ort-fused growing",
                         "onnx growing", "decomposed buffer",
                         "decomposed growing", "torch eager", "torch static", *ov}  # fmt: skip
        assert all(t > 0 for t in r["times_ms"].values())
    assert main(["bench", "--preset", "tiny", "--decode", "--kv-heads", "3"]) == 2  # must divide n_heads


def test_decode_refusals_before_any_work(capsys):
    """A past the machine cannot hold and a step count out of range: exit 2, one line, nothing run."""
    assert main(["bench", "--preset", "large", "--decode", "--past", "100000000"]) == 2
    assert "not started: it needs" in capsys.readouterr().err
    assert main(["bench", "--preset", "tiny", "--decode", "--past", "8", "--max-mem-gb", "0.5"]) == 2


# int8/int4 step weights (issue 13, deliverable 8) ---------------------------------------------------
def test_weight_bytes_are_the_quantized_models_own():
    """weight_bytes(dtype) is what the quantized step model stores: its projections' initializers
    (int8: 1 byte a weight + scale + zero point per channel; int4: half a byte + per-block scale
    and 4-bit zero point), the biases in float32; in both forms (the buffer form packs q/k/v)."""
    import numpy as np
    from onnx import numpy_helper

    from attnx.bench import weight_bytes
    from attnx.bench._decode import DEFAULT_BLOCK_SIZE
    from attnx.export import build_step_model
    from attnx.export.passes import DEFAULT_BLOCK_SIZE as PASS_BLOCK_SIZE
    from attnx.model.weights import init_weights

    assert DEFAULT_BLOCK_SIZE == PASS_BLOCK_SIZE
    c = AttentionConfig(d_model=96, n_heads=4, n_kv_heads=2, causal=True, kv_cache=True)  # K = 96: 3 int4 blocks
    w = init_weights(c, 0)
    assert weight_bytes(c, "fp32") == 4 * c.n_params
    for dtype in ("int8", "int4"):
        for form in ("growing", "buffer"):
            model = build_step_model(c, w, "ort-fused", form, dtype)
            names = {i for n in model.graph.node if n.domain == "com.microsoft" and n.name.split("/")[0].endswith("_proj")
                     for i in n.input[1:]} | {i.name for i in model.graph.initializer if i.name.endswith(".bias")}  # fmt: skip
            stored = sum(numpy_helper.to_array(i).nbytes for i in model.graph.initializer if i.name in names)
            assert weight_bytes(c, dtype) == stored, (dtype, form)
    assert weight_bytes(c, "int4") < weight_bytes(c, "int8") < weight_bytes(c, "fp32") / 3
    assert step_bytes(c, 64, dtype="int8") - step_bytes(c, 64) == weight_bytes(c, "int8") - 4 * c.n_params
    assert np.isclose(weight_bytes(preset("large"), "int8") / (4 * preset("large").n_params), 0.25, atol=0.01)


def test_cli_bench_decode_dtypes(tmp_path, capsys):
    out = tmp_path / "d.json"
    # one round: decode's default three (the order rotated between them) run in test_cli_bench_decode above
    assert main(["bench", "--preset", "tiny", "--decode", "--past", "8", "--kv-heads", "2", "--repeat", "2",
                 "--threads", "1", "--rounds", "1", "--dtype", "fp32,int8,int4", "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "ort-fused buffer int8" in text and "ort-fused growing int4" in text
    (row,) = json.loads(out.read_text())["rows"]
    impls = {k.rsplit(" ", 1)[0] for k in row["times_ms"]}
    assert {
        "ort-fused buffer int8",
        "ort-fused buffer switch int8",
        "ort-fused growing int8",
        "ort-fused buffer int4",
        "ort-fused buffer switch int4",
        "ort-fused growing int4",
    } <= impls
    assert row["step_bytes"] > row["dtype_bytes"]["int8"] > row["dtype_bytes"]["int4"]
    assert main(["bench", "--preset", "tiny", "--decode", "--dtype", "fp16"]) == 2
    assert "fp32, int8, int4" in capsys.readouterr().err


# Modern LLM attention (issue 22, item 6) ------------------------------------------------------------
def test_torch_peers_compute_the_formula():
    """The decode bench's torch peers (growing cache with torch.cat, static cache with index_copy_)
    rotate and normalize as the formula: one step from a reference prefill equals the reference's."""
    import dataclasses

    import numpy as np
    import torch

    from attnx.bench._decode import _TorchPeer
    from attnx.model import init_weights, reference_attention
    from tests.conftest import LLM_CONFIGS

    base = dataclasses.replace(LLM_CONFIGS["llama"], kv_cache=True)
    for config in (base, dataclasses.replace(base, qk_norm={"eps": 1e-5}, rope={**base.rope.to_dict(), "dim": 8}),
                   dataclasses.replace(base, rope={**base.rope.to_dict(), "interleaved": True}),
                   dataclasses.replace(base, softcap=0.5, sliding_window=3),  # Gemma 2's terms: eager, last W keys
                   dataclasses.replace(base, sinks=True, sliding_window=4),  # gpt-oss's
                   # Llama 4's: its chunk's keys alone (token 5 of chunks of 3 sees 3..5), the temperature at 5
                   dataclasses.replace(LLM_CONFIGS["llama4"], kv_cache=True, key_padding_mask=False),
                   dataclasses.replace(LLM_CONFIGS["llama4-nope"], kv_cache=True, key_padding_mask=False)):  # fmt: skip
        w = init_weights(config, 3)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 6, config.d_model)).astype(np.float32)
        empty = np.zeros((1, config.n_kv_heads, 0, config.head_dim), np.float32)
        pos = np.arange(6, dtype=np.int64)[None]
        y, k, v = reference_attention(config, w, x, past_key=empty, past_value=empty,
                                      **({"position_ids": pos} if config.rope is not None else {}))
        peer = _TorchPeer(config, {n: torch.from_numpy(np.asarray(a, np.float32)) for n, a in w.items()}, 5)
        with torch.inference_mode():
            q, kn, vn = peer.qkv(torch.from_numpy(x[:, 5:]))
            past = (torch.from_numpy(k[:, :, :5].astype(np.float32)), torch.from_numpy(v[:, :, :5].astype(np.float32)))
            got = peer.attend(q, torch.cat([past[0], kn], 2), torch.cat([past[1], vn], 2)).numpy()
        assert np.abs(got - y[:, 5:]).max() < 1e-4 * np.abs(y).max(), config
        assert np.abs(kn.numpy() - k[:, :, 5:]).max() < 1e-4 * np.abs(k).max()


def test_cli_bench_decode_of_a_rope_config(tmp_path, capsys):
    import dataclasses

    from tests.conftest import LLM_CONFIGS

    path = tmp_path / "c.json"
    path.write_text(json.dumps(dataclasses.replace(LLM_CONFIGS["llama"], qk_norm={"eps": 1e-6}).to_dict()))
    assert main(["bench", "--config", str(path), "--decode", "--past", "8", "--repeat", "2", "--rounds", "1",
                 "--threads", "1", "--dtype", "fp32,int8"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "torch static" in text and "ort-fused buffer int8" in text and "static/this" in text
    # softcap, a window and sinks: the peers attend as transformers' eager attention; the onnx lowering,
    # which has no sinks, is left out with its reason
    gpt_oss = dataclasses.replace(LLM_CONFIGS["llama"], softcap=30.0, sliding_window=4, sinks=True)
    path.write_text(json.dumps(gpt_oss.to_dict()))
    assert main(["bench", "--config", str(path), "--decode", "--past", "8", "--repeat", "2", "--rounds", "1",
                 "--threads", "1"]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert "torch static" in out.out and "ort-fused buffer" in out.out and "onnx growing" not in out.out
    assert "onnx growing" in out.err and "sinks" in out.err


def test_cli_bench_decode_of_a_latent_config(tmp_path, capsys):
    """A latent (MLA) config's step timed over its own cache (past_latent, cache_specs); the cores that cannot
    express it and the torch peers (per-head k and v) left out with their reasons; its bound reads 1 x (rope +
    kv_lora_rank) values a cached token."""
    from tests.model.test_latent import MLA

    path, out = tmp_path / "c.json", tmp_path / "o.json"
    path.write_text(json.dumps(MLA.to_dict()))
    assert main(["bench", "--config", str(path), "--decode", "--past", "8,40", "--repeat", "2", "--rounds", "1",
                 "--threads", "1", "--batch", "2", "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr()
    assert "decomposed growing" in text.out and "torch static" not in text.out and "torch eager" in text.err
    assert "decomposed buffer" in text.out and "ort-fused buffer" in text.err  # the latent's buffer form: its own
    rows = json.loads(out.read_text())["rows"]
    # 32 more cached tokens in each of 2 rows, 4 B a value
    assert rows[1]["step_bytes"] - rows[0]["step_bytes"] == 2 * 32 * (8 + 32) * 4 and rows[0]["batch"] == 2
