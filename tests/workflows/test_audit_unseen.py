"""attnx audit on the second fixture set (tests/fixtures/unseen, models.json there): whole models the builder,
torch.onnx and Optimum made from checkpoints of other shapes than the first set's (head_dim 32 and 64, one kv head,
3-4 layers, windows 5 and 6, llama3 and longrope ropes, partial rotary, batches fixed at 1), each confirmed against
transformers when made. Every one that agrees passes; the two that do not are found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnx.cli import main
from attnx.workflows.audit import audit_model

# the same fixture models read again and again: each rotary table's named scaling searched once (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("rope_tables_named_once")

UNSEEN = Path(__file__).resolve().parents[1] / "fixtures" / "unseen"
MODELS = {m["path"].removesuffix("/model.onnx"): m for m in json.loads((UNSEEN / "models.json").read_text())}


def _audit(name: str, **options):
    m = MODELS[name]
    return audit_model(str(UNSEEN / m["path"]), checkpoint=str(UNSEEN / m["checkpoint"]), **options)


def _layers(name: str) -> int:
    return json.loads((UNSEEN / MODELS[name]["checkpoint"] / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize("name", [n for n, m in MODELS.items() if m["agrees"]])
def test_every_model_that_agrees_with_transformers_passes(name):
    report = _audit(name)
    assert report.passed, [b.findings + b.not_checked for b in report.blocks] + report.unread + report.findings
    assert [b.layer for b in report.blocks] == list(range(_layers(name)))
    fixed = MODELS[name]["batch"] == 1
    cached = MODELS[name]["cache"]
    for block in report.blocks:  # full sequence, a padded batch unless fixed at one row or refused, decoding
        names = [c.name.split(" (")[0] for c in block.checks]
        assert names[0] == "full sequence" and ("prefill 9 + 3 steps" in names) == cached
        assert ("padded batch" in names) == (not fixed and not block.not_checked), (names, block.not_checked)
    assert bool(report.not_applicable) == fixed


def test_a_batch_fixed_at_one_runs_one_row_and_says_the_padded_batch_does_not_apply(capsys):
    """torch.onnx with only the sequence dynamic: every check at batch 1, the padded batch named once as not
    applicable (it failed every block before: 'Got: 2 Expected: 1'); exit 0."""
    m = MODELS["exported/torch-dynamo/llama/sdpa-opset20-b1"]
    assert main(["audit", str(UNSEEN / m["path"]), "--checkpoint", str(UNSEEN / m["checkpoint"])]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == ("not applicable: a padded batch: the model's batch is fixed at 1 (input input_ids "
                       "[1, sequence_length])")  # fmt: skip
    assert out[-1] == "audit PASSED: 3 of 3 block(s) pass"


@pytest.mark.parametrize("name", ["genai/mistral/fp32", "genai/gemma2/fp32", "genai/gpt-oss/fp32"])
def test_a_ring_buffer_window_passes_with_its_gap_named_and_fails_under_strict(name, capsys):
    """The builder keeps these windows in a ring buffer (sliding_window_cache); ONNX Runtime then refuses a padded
    batch: exit 0 with one 'not checked' line per windowed block, exit 1 with --strict."""
    m = MODELS[name]
    args = ["audit", str(UNSEEN / m["path"]), "--checkpoint", str(UNSEEN / m["checkpoint"])]
    assert main(args) == 0
    out = capsys.readouterr().out
    gaps = [line for line in out.splitlines() if line.startswith("  not checked: ")]
    assert gaps and all("cannot serve prompts of different lengths in one batch" in line for line in gaps)
    plural = "s" if len(gaps) != 1 else ""
    assert out.splitlines()[-1].endswith(f"{len(gaps)} check{plural} could not run (the 'not checked' lines), which "
                                         "--strict fails on")  # fmt: skip
    assert main([*args, "--strict"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("audit FAILED (--strict): ")


def test_the_builder_s_fp16_model_still_fails_its_first_decode_step():
    report = _audit("genai/llama/fp16")
    assert all(b.passed for b in report.blocks) and not report.passed
    [finding] = report.findings
    assert finding.startswith("the whole model as exported fails at decoding step 1 (after 9 tokens) on ort-cpu: ")


def test_optimum_s_gemma2_drops_the_softcap_in_every_layer():
    report = _audit("exported/optimum/gemma2")
    assert [b.findings[0] for b in report.blocks] == [f"layer {i}: softcap None in the graph, 30.0 in the checkpoint"
                                                      for i in range(4)]  # fmt: skip


def test_a_longrope_phi3_is_held_to_both_tables():
    """The builder's Phi-3 (partial rotary 0.5, longrope, config.json in the Hub's transformers-4 form) computes its
    cos/sin caches with an If on the prompt's length: read on each side of original_max_position_embeddings (64)."""
    report = _audit("genai/phi3/fp32")
    assert report.passed and all("rope" in b.terms for b in report.blocks)
