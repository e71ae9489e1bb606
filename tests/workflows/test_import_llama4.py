"""attnx import of Llama 4's attention (issue 39, item 5), a check kept apart from the work: its own tiny random
Llama 4 text checkpoint (transformers 5.24's Llama4TextModel), imported layer by layer and checked against
transformers' own layer on a left-padded batch, full sequence and as a prefill then single steps, and through
every lowering that expresses the layer (the full-sequence graph and the step model), the others refused by name.

Layers 0-2 rotate (rope on interleaved pairs with llama3 scaling, chunked attention of 3 tokens counted from
each row's first token, the weightless q/k norm after rope); layer 3 has no position (NoPE): full causal
attention with the attention temperature (floor_scale 2, attn_scale 0.5: the factor changes every two tokens)."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from attnx.cli import main  # noqa: E402
from attnx.errors import UsageError  # noqa: E402
from attnx.model.config import load_config  # noqa: E402
from attnx.model.importers import import_weights  # noqa: E402
from attnx.model.terms import TERMS  # noqa: E402
from attnx.workflows import check_against_source  # noqa: E402
from tests.workflows._checkpoints import save_wide  # noqa: E402

CHUNKED, NOPE = 1, 3  # a rotating, chunked layer and the NoPE one


def _llama4():
    t = transformers
    return t.Llama4TextModel(t.Llama4TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=4,
        intermediate_size=16, intermediate_size_mlp=16, vocab_size=64, num_local_experts=2, moe_layers=[],
        attention_chunk_size=3, floor_scale=2, attn_scale=0.5, max_position_embeddings=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 4}))  # fmt: skip


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return save_wide(tmp_path_factory.mktemp("llama4"), {"llama4": _llama4})["llama4"]


def _edit(folder, tmp_path, change):
    import shutil

    target = tmp_path / "edited"
    shutil.copytree(folder, target)
    data = json.loads((target / "config.json").read_text())
    change(data)
    (target / "config.json").write_text(json.dumps(data))
    return str(target)


def test_each_kind_of_layer_imports_as_its_terms(llama4):
    chunked = import_weights(llama4, layer=CHUNKED).config
    assert chunked.terms == ("grouped_heads", "rope", "qk_l2_norm", "causal", "attention_chunk", "key_padding_mask")
    assert chunked.rope.interleaved and chunked.rope.rope_type == "llama3" and chunked.rope.theta == 500000.0
    assert chunked.attention_chunk == 3 and chunked.qk_l2_norm == 1e-5 and not chunked.bias
    nope = import_weights(llama4, layer=NOPE).config
    assert nope.terms == ("grouped_heads", "attn_temperature", "causal", "key_padding_mask")
    assert (nope.attn_temperature.floor_scale, nope.attn_temperature.attn_scale) == (2.0, 0.5)


@pytest.mark.parametrize("layer", [CHUNKED, NOPE], ids=["chunked", "nope"])
def test_every_lowering_agrees_with_transformers_full_sequence_and_step_by_step(llama4, layer):
    """The source layer against the float64 reference, then each lowering's full-sequence graph and step model
    (GroupQueryAttention takes the chunks as an additive attention_bias): every one holds."""
    result = import_weights(llama4, layer=layer)
    skipped: list[str] = []
    checks = check_against_source(result, llama4, ("decomposed", "onnx", "ort-fused"), skipped=skipped)
    assert checks and all(checks), [str(c) for c in checks if not c]
    names = [c.name for c in checks]
    assert any(n.startswith("source layer") and "prefill + steps" in n for n in names)
    built = {n.split(" ")[1] for n in names if n.startswith("attnx ")}
    assert built == {"decomposed", "onnx", "ort-fused"} and not skipped, skipped


def _plant(config_change):
    def plant(result):
        import dataclasses

        result.config = dataclasses.replace(result.config, **config_change(result.config))

    return plant


FAULTS = {
    "the chunk one longer": (CHUNKED, lambda c: {"attention_chunk": 4}),
    "a window of 3, not chunks": (CHUNKED, lambda c: {"attention_chunk": None, "sliding_window": 3}),
    "the norm after rope dropped": (CHUNKED, lambda c: {"qk_l2_norm": None}),
    "pairs (i, i + dim/2)": (CHUNKED, lambda c: {"rope": {**c.rope.to_dict(), "interleaved": False}}),
    "the temperature dropped": (NOPE, lambda c: {"attn_temperature": None}),
    "attn_scale doubled": (NOPE, lambda c: {"attn_temperature": TERMS["attn_temperature"].fault(c, {})[0]
                                            .attn_temperature}),
}  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS)
def test_a_planted_fault_fails_the_check(llama4, fault):
    layer, change = FAULTS[fault]
    result = import_weights(llama4, layer=layer)
    _plant(change)(result)
    checks = check_against_source(result, llama4, (), forms=())
    outputs = [c for c in checks if c.name.startswith("source layer")]
    assert len(outputs) == 2 and not any(outputs), [str(c) for c in outputs]


def test_no_rope_layers_omitted_is_every_fourth_layer_and_a_bad_list_is_refused(llama4, tmp_path):
    def drop(d):
        d.pop("no_rope_layers")
        d.pop("layer_types")

    folder = _edit(llama4, tmp_path, drop)
    assert import_weights(folder, layer=2).config.rope is not None
    assert import_weights(folder, layer=3).config.rope is None
    bad = _edit(llama4, tmp_path / "bad", lambda d: d.update(no_rope_layers=[1, 2, 1, 0]))
    with pytest.raises(UsageError, match="no_rope_layers"):
        import_weights(bad, layer=0)


def test_the_cli_imports_the_nope_layer_with_its_check_and_step_model(llama4, tmp_path, capsys):
    out = tmp_path / "nope"
    code = main(["import", llama4, "--layer", str(NOPE), "--check", "--kv-cache", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "attnx decomposed step model present_key" in text and "FAIL" not in text
    assert "q scaled by log1p(floor((i + 1) / 2)) * 0.5 + 1" in text
    config = load_config(out / "config.json")
    assert config.kv_cache and config.attn_temperature is not None and config.rope is None


def test_the_buffer_form_refuses_each_llama4_term_by_name(llama4):
    """The buffer form's cores rotate and mask inside the op from the buffer's own token count: a term written
    around it (the norm after rope, the temperature, the chunks) is refused naming the term."""
    import dataclasses

    from attnx.model.cores import core_for

    for layer, terms in ((CHUNKED, ("qk_l2_norm", "attention_chunk")), (NOPE, ("attn_temperature",))):
        step = dataclasses.replace(import_weights(llama4, layer=layer).config, kv_cache=True, key_padding_mask=False)
        for buffer_core in ("gqa", "grouped-mha"):
            with pytest.raises(UsageError) as refused:
                core_for("ort-fused", step, form="buffer", buffer_core=buffer_core)
            assert all(term in str(refused.value) for term in terms), str(refused.value)


@pytest.mark.parametrize(("model_type", "text"), [("llama4", "llama4_text"), ("gemma3", "gemma3_text")])
def test_a_multimodal_checkpoint_is_refused_naming_its_text_model(llama4, tmp_path, model_type, text):
    folder = _edit(llama4, tmp_path, lambda d: d.update(model_type=model_type))
    with pytest.raises(UsageError, match=f"multimodal checkpoint .*a {text} checkpoint"):
        import_weights(folder, layer=0)
