"""A whole DeepSeek-V3 decoder exported by torch.onnx (tests/fixtures/exported/make_mla.py: transformers 5.24 caches
MLA's latent, the compressed kv and the rope key): attnx audit and attnx optimize find each block and name what it is,
multi-head latent attention, which attnx imports from a checkpoint but does not read from a graph: never misread
(as the cross attention its separately projected q once read as), never rewritten on a guess."""

from __future__ import annotations

import os

import pytest

from attnx.cli import main

MODEL = os.path.join(os.path.dirname(__file__), "..", "fixtures", "exported", "torch-dynamo", "deepseek_v3", "sdpa",
                     "model.onnx")  # fmt: skip


@pytest.mark.parametrize("command", ["audit", "optimize"])
def test_an_exported_mla_decoder_is_named_as_latent_attention_not_read(command, tmp_path, capsys):
    extra = ["--out", str(tmp_path / "out.onnx")] if command == "optimize" else []
    assert main([command, MODEL, *extra]) == 1
    err = capsys.readouterr()
    lines = [line for line in (err.out + err.err).splitlines() if line.startswith("not read:")]
    assert len(lines) == 2, lines  # its two layers' blocks
    assert all("multi-head latent attention (the latent term)" in line and "from present." in line for line in lines)
    assert not any("cross attention" in line for line in lines)
    assert not (tmp_path / "out.onnx").exists()  # nothing written on a guess
