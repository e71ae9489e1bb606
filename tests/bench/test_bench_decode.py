"""attnx bench --decode: the step's bytes, the bound, and the report (numbers are for the note, not here)."""

from __future__ import annotations

import json

from attnx.bench import step_bytes
from attnx.cli import main
from attnx.model import AttentionConfig, preset


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
    assert data["config"]["n_kv_heads"] == 2 and data["config"]["kv_cache"] and data["machine"]["cpu"]
    assert [r["past"] for r in data["rows"]] == [8, 32]
    for r in data["rows"]:
        assert abs(r["bound_ms"] - r["step_bytes"] / (r["bandwidth_gbs"] * 1e9) * 1e3) < 1e-9
        assert r["bandwidth_gbs"] == max(r["copies_gbs"].values())
        impls = {k.rsplit(" ", 1)[0] for k in r["times_ms"]}
        assert impls == {"ort-fused buffer", "ort-fused growing", "onnx growing", "decomposed growing", "torch eager"}
        assert all(t > 0 for t in r["times_ms"].values())
    assert main(["bench", "--preset", "tiny", "--decode", "--kv-heads", "3"]) == 2  # must divide n_heads


def test_decode_refusals_before_any_work(capsys):
    """A past the machine cannot hold and a step count out of range: exit 2, one line, nothing run."""
    assert main(["bench", "--preset", "large", "--decode", "--past", "100000000"]) == 2
    assert "not started: it needs" in capsys.readouterr().err
    assert main(["bench", "--preset", "tiny", "--decode", "--past", "8", "--max-mem-gb", "0.5"]) == 2
