"""attnx audit of Llama 4 (issue 39, item 5): torch.onnx's dynamo exports of a tiny Llama 4 text model with its
KV cache (tests/fixtures/exported/torch-dynamo/llama4: eager and sdpa attention, each confirmed against
transformers when made), read block by block: the rotating layers' interleaved rope, weightless q/k norm after it
and chunked mask, the NoPE layer's temperature. Held to the checkpoint, every block passes; a checkpoint that
states another chunk, temperature or no norm is found in each layer it touches, in its term's words."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from attnx.workflows.audit import audit_model

# the same fixture models read again and again: each rotary table's named scaling searched once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rope_tables_named_once")

LLAMA4 = Path(__file__).resolve().parents[1] / "fixtures" / "exported" / "torch-dynamo" / "llama4"
ROTATING, NOPE = ["grouped_heads", "rope", "qk_l2_norm", "attention_chunk"], ["grouped_heads", "attn_temperature"]


@pytest.mark.parametrize("export", ["eager-opset20", "sdpa-opset20"])
def test_every_block_of_the_export_is_read_with_its_terms_and_passes(export):
    report = audit_model(str(LLAMA4 / export / "model.onnx"), checkpoint=str(LLAMA4 / "checkpoint"))
    assert report.passed, [b.findings + b.not_checked for b in report.blocks] + report.unread + report.findings
    assert [b.layer for b in report.blocks] == [0, 1, 2, 3]
    assert [list(b.terms) for b in report.blocks] == [ROTATING, ROTATING, ROTATING, NOPE]
    for block in report.blocks:
        assert [c.name.split(" (")[0] for c in block.checks] == ["full sequence", "padded batch",
                                                                 "prefill 9 + 3 steps"]  # fmt: skip


CHANGES = {
    "chunk": ({"attention_chunk_size": 5}, [0, 1, 2], "chunks of 4 in the graph (its mask: causal, chunks of 4), "
                                                      "attention_chunk 5 in the checkpoint"),
    "floor_scale": ({"floor_scale": 5}, [3], "temperature floor_scale 4, attn_scale 0.5 in the graph, 5, 0.5 in "
                                             "the checkpoint"),
    "no norm": ({"use_qk_norm": False}, [0, 1, 2], "the q/k norm after rope in the graph, not in the checkpoint"),
}  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
def test_a_checkpoint_that_states_another_term_is_found_in_each_layer(change, tmp_path):
    keys, layers, said = CHANGES[change]
    folder = tmp_path / "checkpoint"
    shutil.copytree(LLAMA4 / "checkpoint", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(keys)
    if "attention_chunk_size" in keys:
        config.pop("layer_types", None)  # made again from the chunk size, as transformers does
    (folder / "config.json").write_text(json.dumps(config))
    report = audit_model(str(LLAMA4 / "eager-opset20" / "model.onnx"), checkpoint=str(folder))
    assert not report.passed
    for block in report.blocks:
        found = [f for f in block.findings if said in f]
        assert bool(found) == (block.layer in layers), (block.layer, block.findings)
        assert all(f.startswith(f"layer {block.layer}: ") for f in found)
