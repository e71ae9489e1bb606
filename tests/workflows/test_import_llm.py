"""attnx import of the rotary decoders (issue 22): tiny random Hugging Face models of each family
(transformers, a test extra), saved as checkpoints, imported, and checked against the family's own
transformers layer on a left-padded batch with Hugging Face's position_ids, full-sequence and as a
prefill then single-token steps; the older and newer spellings of the rope keys, the class defaults
of keys a checkpoint omits, the refusals, and planted faults that the check must catch.

Cost: the step model exports by hand (milliseconds); the full-sequence graph goes through torch's
dynamo exporter (seconds), so it is exported for one family here (gpt-oss, every term but the norms,
through the CLI); the full-sequence graph of each term is covered by tests/export/test_llm_export.py."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from attnx.cli import main  # noqa: E402
from attnx.errors import UsageError  # noqa: E402
from attnx.model.config import load_config  # noqa: E402
from attnx.model.importers import import_weights  # noqa: E402
from attnx.model.weights import load_weights  # noqa: E402
from attnx.workflows import _build, check_against_source, import_model  # noqa: E402
from tests.workflows._checkpoints import save_wide  # noqa: E402

SMALL = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=16,
             vocab_size=64)  # fmt: skip


def _families():
    """name -> (model, the layer checked). Each family's own terms, small enough to show in 9 tokens:
    windows of 4, softcap 2, scales and rope thetas that are not the defaults."""
    t = transformers
    return {
        "llama": (lambda: t.LlamaModel(t.LlamaConfig(**SMALL, max_position_embeddings=64, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})), 1),
        "mistral": (lambda: t.MistralModel(t.MistralConfig(**SMALL, sliding_window=4)), 1),
        # layers from max_window_layers on slide
        "qwen2": (lambda: t.Qwen2Model(t.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=4,
                                                     max_window_layers=1)), 1),
        "qwen3": (lambda: t.Qwen3Model(t.Qwen3Config(**SMALL, head_dim=16, rms_norm_eps=1e-5)), 1),
        # layer 0 slides (the alternating default); scale 24^-1/2, not head_dim's
        "gemma2": (lambda: t.Gemma2Model(t.Gemma2Config(**SMALL, head_dim=8, query_pre_attn_scalar=24,
                                                        sliding_window=4, attn_logit_softcapping=2.0)), 0),
        # the local layer's own theta (100), the global one's linear scaling
        "gemma3_text": (lambda: t.Gemma3TextModel(t.Gemma3TextConfig(
            **SMALL, head_dim=8, query_pre_attn_scalar=16, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})), 0),
        # partial rotary (half of each head) and longrope; the top-level original length (6) overrides
        # the rope dict's (100), and the check's positions (to 8) cross it mid-decode
        "phi3": (lambda: t.Phi3Model(t.Phi3Config(
            **SMALL, max_position_embeddings=64, original_max_position_embeddings=6, pad_token_id=0,
            eos_token_id=1, rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5], "long_factor": [2.0, 5.0], "original_max_position_embeddings": 100})), 1),
        "gpt_oss": (lambda: t.GptOssModel(t.GptOssConfig(
            **SMALL, head_dim=8, sliding_window=4, num_local_experts=2, num_experts_per_tok=1,
            max_position_embeddings=64, rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 16})), 0),
    }  # fmt: skip


FAMILIES = _families()


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """Every family saved once, weights drawn wide (std 0.5): peaked attention, so that a wrong
    mapping, scale, window or rotation shows in the check."""
    return save_wide(tmp_path_factory.mktemp("hf-decoders"), {name: make for name, (make, _) in FAMILIES.items()})


def _edit(folder, tmp_path, name, change):
    """A copy of the checkpoint folder with its config.json changed by `change(dict)`."""
    target = tmp_path / name
    shutil.copytree(folder, target)
    data = json.loads((target / "config.json").read_text())
    change(data)
    (target / "config.json").write_text(json.dumps(data))
    return str(target)


def _expected(name, config, weights, folder):
    """What each family's import must say, beyond agreeing with its source."""
    rope = config.rope
    assert config.causal and config.key_padding_mask and config.n_kv_heads == 2 and not config.cross
    if name == "llama":
        assert rope.theta == 500000.0 and rope.rope_type == "llama3" and rope.scaling["factor"] == 8.0
    if name == "mistral":
        assert config.sliding_window == 4 and not config.bias
    if name == "qwen2":  # q/k/v biases, none on o: a zero bias there
        assert config.bias and config.sliding_window == 4 and not weights["out_proj.bias"].any()
        assert weights["q_proj.bias"].any()
    if name == "qwen3":
        assert config.head_dim == 16 and config.qk_norm.eps == 1e-5 and config.sliding_window is None
    if name == "gemma2":
        assert config.scale == 24**-0.5 and config.softcap == 2.0 and config.sliding_window == 4
    if name == "gemma3_text":  # the stored norm weights w, folded as 1 + w
        assert config.scale == 0.25 and rope.theta == 100.0 and rope.scaling is None and config.sliding_window == 4
        from safetensors.numpy import load_file

        stored = load_file(f"{folder}/model.safetensors")["layers.0.self_attn.q_norm.weight"]
        assert np.array_equal(weights["q_norm.weight"], np.float32(1) + stored)
    if name == "phi3":
        s = rope.scaling
        assert rope.dim == 4 and s["original_max_position_embeddings"] == 6 and not config.bias
        assert s["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(64 / 6) / math.log(6)))
    if name == "gpt_oss":
        assert config.sinks and config.bias and config.sliding_window == 4
        assert rope.scaling["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1)
        assert rope.scaling["truncate"] is False


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "gpt_oss"])
def test_each_family_agrees_with_its_source_full_sequence_and_step_by_step(decoders, name):
    """The source layer (transformers, eager) full-sequence and prefill + steps, and attnx's step model
    (decomposed), each against attnx's float64 reference."""
    result = import_weights(decoders[name], layer=FAMILIES[name][1])
    _expected(name, result.config, result.weights, decoders[name])
    checks = check_against_source(result, decoders[name], ("decomposed",), forms=("step",))
    assert len(checks) == 6 and all(checks), [str(c) for c in checks if not c]
    assert [c.name.split(" vs ")[0] for c in checks[:3]] == ["rope table", "source layer", "source layer"]
    assert "full sequence" in checks[1].name and "prefill + steps" in checks[2].name


def test_an_import_checked_against_its_source_writes_the_folder(decoders, tmp_path):
    report = import_model(decoders["gemma3_text"], tmp_path / "g3", layer=0, check=True, lowerings=())
    assert report.passed and len(report.checks) == 3, [str(c) for c in report.checks if not c]
    config = load_config(tmp_path / "g3" / "config.json")
    weights = load_weights(tmp_path / "g3" / "weights.safetensors", config)
    assert config == report.result.config and not config.kv_cache
    _expected("gemma3_text", config, weights, decoders["gemma3_text"])


@pytest.mark.slow
def test_the_cli_imports_gpt_oss_with_its_check_then_builds_and_verifies_its_package(decoders, tmp_path, capsys,
                                                                                    monkeypatch):
    """attnx import --check --kv-cache, then attnx build of the imported step model (decomposed; its decode
    parity cut to prefills 0 and 5 + 6 steps for the test) and attnx verify of the package."""
    out = tmp_path / "oss"
    code = main(["import", decoders["gpt_oss"], "--layer", "0", "--check", "--kv-cache", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "source layer vs attnx reference, prefill + steps" in text and "FAIL" not in text
    assert "attnx decomposed full-sequence graph" in text and "attnx decomposed step model present_key" in text
    assert "sinks <- layers.0.self_attn.sinks" in text
    config = load_config(out / "config.json")
    assert config.kv_cache and config.sinks
    _expected("gpt_oss", config, load_weights(out / "weights.safetensors", config), decoders["gpt_oss"])
    monkeypatch.setattr(_build, "STEP_PARITY", {"prefills": (0, 5), "steps": 6, "batch": 3})
    pkg = tmp_path / "pkg"
    assert main(["build", "--config", str(out / "config.json"), "--weights", str(out / "weights.safetensors"),
                 "--attention", "decomposed", "--provider", "cpu", "--out", str(pkg)]) == 0  # fmt: skip
    assert main(["verify", str(pkg)]) == 0
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["config"] == config.to_dict() and "position_ids" in manifest["golden"][0]["inputs"]


def test_a_lowering_that_does_not_express_the_config_is_skipped_by_name(decoders):
    result = import_weights(decoders["mistral"], layer=1)
    skipped = []
    checks = check_against_source(result, decoders["mistral"], ("onnx",), skipped=skipped, forms=("step",))
    assert len(checks) >= 3 and all(checks)
    if len(checks) == 3:  # the onnx step model of a rope config is not built yet
        assert len(skipped) == 1 and skipped[0].startswith("attnx onnx step model: ") and "rope" in skipped[0]


def test_older_rope_keys_import_as_the_newer_and_agree_with_transformers(decoders, tmp_path):
    """rope_theta + rope_scaling ("type"), Gemma 3's rope_local_base_freq, Phi-3's rope_scaling without
    original_max_position_embeddings: the same config as rope_parameters, and transformers agrees."""

    def llama(d):
        p = d.pop("rope_parameters")
        d["rope_theta"] = p.pop("rope_theta")
        d["rope_scaling"] = {"type": p.pop("rope_type"), **p}

    def gemma3(d):
        p = d.pop("rope_parameters")
        d["rope_theta"], d["rope_local_base_freq"] = p["full_attention"]["rope_theta"], 100.0
        d["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}

    def phi3(d):
        p = d.pop("rope_parameters")
        d["rope_theta"], d["partial_rotary_factor"] = p.pop("rope_theta"), p.pop("partial_rotary_factor")
        # Phi-3's rope_scaling as its checkpoints have it: no original length in the dict (the top-level one)
        d["rope_scaling"] = {"type": "longrope", "short_factor": p["short_factor"], "long_factor": p["long_factor"]}

    for name, change in (("llama", llama), ("gemma3_text", gemma3), ("phi3", phi3)):
        layer = FAMILIES[name][1]
        old = _edit(decoders[name], tmp_path, name, change)
        assert "rope_parameters" not in json.loads(open(f"{old}/config.json").read())
        new_result, old_result = import_weights(decoders[name], layer=layer), import_weights(old, layer=layer)
        assert old_result.config == new_result.config, name
        checks = check_against_source(old_result, old, (), forms=())
        assert all(checks), (name, [str(c) for c in checks])
    # Gemma 3's global (full) layer: rope_scaling applies there, with the global theta
    full = import_weights(f"{tmp_path}/gemma3_text", layer=1).config.rope
    assert full.theta == 1e6 and full.scaling.to_dict() == {"rope_type": "linear", "factor": 2.0}


def test_the_class_defaults_of_omitted_keys_are_what_transformers_uses(decoders, tmp_path):
    """A config.json without sliding_window (Mistral's class default: 4096) or rope_parameters
    (gpt-oss: yarn, factor 32 from 4096, theta 150000): resolved to the numbers transformers uses."""
    mistral = _edit(decoders["mistral"], tmp_path, "mistral", lambda d: d.pop("sliding_window"))
    result = import_weights(mistral, layer=1)
    assert result.config.sliding_window == 4096
    oss = _edit(decoders["gpt_oss"], tmp_path, "gpt_oss", lambda d: d.pop("rope_parameters"))
    oss_result = import_weights(oss, layer=0)
    rope = oss_result.config.rope
    assert rope.theta == 150000.0 and rope.scaling["factor"] == 32.0
    assert rope.scaling["original_max_position_embeddings"] == 4096 and rope.scaling["truncate"] is False
    for folder, r in ((mistral, result), (oss, oss_result)):
        checks = check_against_source(r, folder, (), forms=())
        assert all(checks), [str(c) for c in checks]


def _swap_k_v(r):
    w = r.weights
    w["k_proj.weight"], w["v_proj.weight"] = w["v_proj.weight"], w["k_proj.weight"]


def _rope(r, **change):
    rope = r.config.rope.to_dict()
    for key, value in change.items():
        if key in rope:
            rope[key] = value
        else:
            rope["scaling"][key] = value
    r.config = dataclasses.replace(r.config, rope=rope)


def _unfold(r):
    for name in ("q_norm.weight", "k_norm.weight"):
        r.weights[name] = r.weights[name] - np.float32(1)


def _no_sinks(r):
    r.config = dataclasses.replace(r.config, sinks=False)
    del r.weights["sinks"]


def _config(r, **change):
    r.config = dataclasses.replace(r.config, **change)


# fault -> (family, how it is planted, which checks must fail: the source layer's outputs, or the rope
# table: a wrong low frequency turns the check's positions (to 8) by too little to show in the outputs)
FAULTS = {
    "gemma3 norm weights w, not 1 + w": ("gemma3_text", _unfold, "outputs"),
    "gemma3 local layer with the global theta": ("gemma3_text", lambda r: _rope(r, theta=1e6), "both"),
    "llama k and v swapped": ("llama", _swap_k_v, "outputs"),
    "llama pairs (2i, 2i+1)": ("llama", lambda r: _rope(r, interleaved=True), "outputs"),
    "llama3 scaling factor 4, not 8": ("llama", lambda r: _rope(r, factor=4.0), "both"),
    "mistral window off by one": ("mistral", lambda r: _config(r, sliding_window=5), "outputs"),
    "gemma2 scale head_dim^-1/2": ("gemma2", lambda r: _config(r, scale=None), "outputs"),
    "gpt-oss sinks dropped": ("gpt_oss", _no_sinks, "outputs"),
    "gpt-oss yarn's attention_factor of 1": ("gpt_oss", lambda r: _rope(r, attention_factor=1.0), "both"),
    "phi3 the rope dict's original length": ("phi3", lambda r: _rope(r, original_max_position_embeddings=100),
                                             "outputs"),
}  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS)
def test_a_planted_fault_fails_the_check(decoders, fault):
    name, plant, fails = FAULTS[fault]
    result = import_weights(decoders[name], layer=FAMILIES[name][1])
    plant(result)
    table, *outputs = check_against_source(result, decoders[name], (), forms=())
    assert len(outputs) == 2 and "rope table" in table.name
    assert bool(table) == (fails == "outputs"), str(table)
    assert not any(outputs) if fails != "table" else all(outputs), [str(c) for c in outputs]


def test_what_the_formula_does_not_express_is_refused_by_name(decoders, tmp_path):
    cases = {
        "dynamic": ("llama", lambda d: d.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0})),
        "index_topk keys": ("llama", lambda d: d.update(model_type="deepseek_v32")),
        "ALiBi": ("llama", lambda d: d.update(model_type="falcon", alibi=True)),
        "not causal": ("gemma3_text", lambda d: d.update(use_bidirectional_attention=True)),
        "partial_rotary_factor": ("llama", lambda d: d["rope_parameters"].update(partial_rotary_factor=0.5)),
        "rope_type 'proportional'": ("llama", lambda d: d.update(rope_parameters={"rope_type": "proportional",
                                                                                  "rope_theta": 10000.0})),
    }  # fmt: skip
    for i, (needle, (name, change)) in enumerate(cases.items()):
        folder = _edit(decoders[name], tmp_path, f"{name}-{i}", change)
        with pytest.raises(UsageError, match=needle):
            import_weights(folder, layer=0)
    code = main(["import", f"{tmp_path}/llama-0", "--out", str(tmp_path / "o")])
    assert code == 2 and not (tmp_path / "o").exists()
