"""attnx import of DeepSeek's multi-head latent attention (MLA; the config's `latent`): tiny random DeepSeek-V3, V2,
GLM-4.7-Flash (glm4_moe_lite) and MiniCPM3 checkpoints (transformers, dense MLP layers), imported and checked against
transformers' own DeepseekV3Attention, Glm4MoeLiteAttention, DeepseekV2Attention and MiniCPM3Attention on a
left-padded batch with Hugging Face's position_ids, full-sequence and as a prefill then
single-token steps: q through q_lora_rank and from a plain q_proj, v_head_dim unlike the qk head size, interleaved
and half-split rope pairs, a yarn rope whose mscale enters the softmax scale; the decomposed lowering's step model
over the latent cache too. Every lowering that cannot build a form refuses it naming the term; a planted fault
fails the check.

Cost: four checkpoints saved once (~3 s); the full-sequence graph through torch's dynamo exporter is the slow test."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from attnx.cli import main  # noqa: E402
from attnx.errors import UsageError  # noqa: E402
from attnx.model.importers import import_weights  # noqa: E402
from attnx.model.terms import TERMS  # noqa: E402
from attnx.workflows import check_against_source  # noqa: E402
from tests.workflows._checkpoints import save_wide  # noqa: E402

# hidden 64, 4 heads of 16 + 8 (q, k) and 16 (v); kv rank 16, q rank 32; both layers dense (first_k_dense_replace)
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=16,
             vocab_size=64, first_k_dense_replace=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=16)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip


def _models():
    t = transformers
    return {
        "v3": lambda: t.DeepseekV3Model(t.DeepseekV3Config(**SMALL, q_lora_rank=32)),
        # a plain q_proj, biases (attention_bias), v heads of 12 against q/k heads of 24, half-split rope pairs
        "v3-plain-q": lambda: t.DeepseekV3Model(t.DeepseekV3Config(**{**SMALL, "v_head_dim": 12}, q_lora_rank=None,
                                                                   rope_interleave=False, attention_bias=True)),
        "v3-yarn": lambda: t.DeepseekV3Model(t.DeepseekV3Config(**SMALL, q_lora_rank=32, max_position_embeddings=64,
                                                                rope_parameters=YARN)),
        "v2": lambda: t.DeepseekV2Model(t.DeepseekV2Config(**SMALL, q_lora_rank=32)),
        # GLM-4.7-Flash: DeepseekV3Attention under glm4_moe_lite's config (its MLP layers by mlp_layer_types)
        "glm4-lite": lambda: t.Glm4MoeLiteModel(t.Glm4MoeLiteConfig(**{k: v for k, v in SMALL.items()
                                                                      if k != "first_k_dense_replace"},
                                                                   q_lora_rank=32, mlp_layer_types=["dense"] * 2)),
        # DeepSeek-V2's MLA with half-split pairs; v_head_dim null: hidden_size / heads (16)
        "minicpm3": lambda: t.MiniCPM3Model(t.MiniCPM3Config(**{k: v for k, v in SMALL.items()
                                                                if k not in ("first_k_dense_replace", "v_head_dim")},
                                                             q_lora_rank=32, v_head_dim=None)),
    }  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_wide(tmp_path_factory.mktemp("hf-mla"), _models())


def _expected(name, config):
    rope, latent = config.rope, config.latent
    assert config.head_dim == 24 and config.n_kv_heads == 4 and rope.dim == 8 and latent.kv_lora_rank == 16
    assert latent.eps == 1e-6 and config.causal and config.key_padding_mask
    assert rope.interleaved == (name not in ("v3-plain-q", "minicpm3"))
    if name == "v3-plain-q":
        assert latent.q_lora_rank is None and config.v_head_dim == 12 and config.bias and config.scale is None
    else:
        assert latent.q_lora_rank == 32 and config.v_head_dim == 16 and not config.bias
    if name == "v3-yarn":  # transformers' yarn_apply_mscale: 24^-1/2 * (0.1 * 0.8 * ln 4 + 1)^2
        assert config.scale == pytest.approx(24**-0.5 * (0.08 * math.log(4.0) + 1) ** 2)
        mscale = (0.1 * math.log(4.0) + 1) / (0.08 * math.log(4.0) + 1)  # attention_factor: the mscale ratio
        assert rope.scaling["attention_factor"] == pytest.approx(mscale)


@pytest.mark.parametrize("name", list(_models()))
def test_each_mla_layer_agrees_with_transformers_in_every_lowering_that_builds_it(checkpoints, name):
    """The source layer (eager) full-sequence and prefill + steps, and the decomposed step model over its latent
    cache, against attnx's float64 reference, within 1e-4; the lowerings that cannot build the step model are skipped
    with a reason naming the latent term."""
    result = import_weights(checkpoints[name], layer=1)
    _expected(name, result.config)
    skipped = []
    checks = check_against_source(result, checkpoints[name], ("decomposed", "onnx", "ort-fused"), skipped=skipped,
                                  forms=("step",))  # fmt: skip
    assert len(checks) == 5 and all(checks), [str(c) for c in checks if not c]
    assert [c.name.split(" vs ")[0] for c in checks] == ["rope table", "source layer", "source layer",
                                                          "attnx decomposed step model y",
                                                          "attnx decomposed step model present_latent"]  # fmt: skip
    assert "full sequence" in checks[1].name and "prefill + steps" in checks[2].name
    assert max(c.max_abs for c in checks[1:]) <= 1e-4  # the target
    assert len(skipped) == 2 and all("latent" in s for s in skipped), skipped


@pytest.mark.slow
def test_the_decomposed_full_sequence_graph_agrees_and_the_others_refuse_it_by_name(checkpoints):
    """The full-sequence graph through torch's dynamo exporter (decomposed, ~15 s), and the lowerings that refuse it
    naming the term: the yarn case (its scale and attention factor in the graph)."""
    result = import_weights(checkpoints["v3-yarn"], layer=1)
    skipped = []
    checks = check_against_source(result, checkpoints["v3-yarn"], ("decomposed", "onnx", "ort-fused"),
                                  skipped=skipped, forms=("full",))  # fmt: skip
    assert len(checks) == 4 and all(checks), [str(c) for c in checks if not c]
    assert checks[3].name.startswith("attnx decomposed full-sequence graph") and checks[3].max_abs <= 1e-4
    assert len(skipped) == 2 and all("latent" in s for s in skipped), skipped


def test_the_imported_layers_step_model_exports_and_passes_decode_parity(checkpoints, tmp_path):
    """The existing machinery on an imported layer: attnx import, attnx export --decode (validated against the
    reference when written) and attnx parity --decode of the step model over its latent cache (left-padded rows)."""
    out, model = tmp_path / "layer", str(tmp_path / "step.onnx")
    assert main(["import", checkpoints["v3-plain-q"], "--layer", "1", "--out", str(out)]) == 0
    files = ["--config", str(out / "config.json"), "--weights", str(out / "weights.safetensors")]
    assert main(["export", *files, "--decode", "--attention", "decomposed", "--out", model]) == 0
    report = tmp_path / "parity.json"
    assert main(["parity", *files, "--model", model, "--decode", "--prefill", "0,3", "--steps", "4", "--batch", "3",
                 "--backends", "ort-cpu,torch", "--json", str(report)]) == 0  # fmt: skip
    cases = json.loads(report.read_text())["cases"]
    assert len(cases) == 4 and all(c["status"] == "pass" for c in cases), cases


def test_a_planted_fault_in_the_latent_fails_the_check(checkpoints):
    result = import_weights(checkpoints["v3"], layer=1)
    _, result.weights = TERMS["latent"].fault(result.config, result.weights)  # kv_b_proj's heads rolled
    checks = check_against_source(result, checkpoints["v3"], (), forms=())
    assert checks[0] and not checks[1] and not checks[2], [str(c) for c in checks]


def _fp8_copy(folder: str, out, block=(16, 8)) -> str:
    """The checkpoint as DeepSeek-V3 publishes its weights: each projection and MLP matrix in FP8 (e4m3) blocks of
    `block`, each block's scale (its max |w| / 448) as `name`_scale_inv, config.json's quantization_config saying so."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{folder}/model.safetensors")
    stored = {}
    for name, w in tensors.items():
        if w.ndim != 2 or "embed" in name or "norm" in name:
            stored[name] = w
            continue
        n, k = w.shape
        b0, b1 = block
        blocks = torch.nn.functional.pad(w, (0, (-k) % b1, 0, (-n) % b0)).reshape(-(-n // b0), b0, -(-k // b1), b1)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        full = scale.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
        stored[name] = (w / full).to(torch.float8_e4m3fn)
        stored[f"{name}_scale_inv"] = scale.to(torch.float32)
    out.mkdir()
    save_file(stored, str(out / "model.safetensors"))
    config = json.loads(open(f"{folder}/config.json").read())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_deepseeks_fp8_blocks_are_read_dequantized_and_checked(checkpoints, tmp_path):
    """DeepSeek-V3's published weights are FP8 blocks with their scales (weight_scale_inv): the import reads each as
    its blocks times their scales (rounded once to float32: transformers' own dequantization of the same tensors,
    bit for bit), and --check holds transformers' attention over them to attnx's (transformers loads FP8 only through
    accelerate, and on a CPU into bfloat16: its model is given the weights as attnx reads them)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    folder = _fp8_copy(checkpoints["v3"], tmp_path / "fp8")
    result = import_weights(folder, layer=1)
    from safetensors.torch import load_file

    stored = load_file(f"{folder}/model.safetensors")
    for ours, theirs in (("q_b_proj", "q_b_proj"), ("kv_b_proj", "kv_b_proj"), ("out_proj", "o_proj")):
        name = f"layers.1.self_attn.{theirs}.weight"
        expected = _dequantize_fp8_weight(stored[name], stored[f"{name}_scale_inv"], [16, 8], torch.float32)
        assert np.array_equal(result.weights[f"{ours}.weight"], expected.numpy())
    checks = check_against_source(result, folder, ("decomposed",), forms=("step",))
    assert all(checks), [str(c) for c in checks if not c]
    assert max(c.max_abs for c in checks[1:]) <= 1e-4


def test_kimi_k2s_own_model_type_is_read_as_deepseek_v3_and_checked(checkpoints, tmp_path):
    """Kimi K2 names DeepseekV3ForCausalLM with model_type kimi_k2 and an auto_map to its own code: read with
    DeepSeek-V3's row, and --check builds transformers' DeepseekV3 from config.json's keys, the checkpoint's code
    never run (a planted configuration file that would raise is not imported)."""
    folder = tmp_path / "kimi"
    shutil.copytree(checkpoints["v3"], folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
                auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})  # fmt: skip
    (folder / "config.json").write_text(json.dumps(data))
    (folder / "configuration_deepseek.py").write_text("raise SystemExit('the checkpoint's own code ran')\n")
    result = import_weights(str(folder), layer=1)
    _expected("v3", result.config)
    checks = check_against_source(result, str(folder), ("decomposed",), forms=("step",))
    assert all(checks), [str(c) for c in checks if not c]
    assert max(c.max_abs for c in checks[1:]) <= 1e-4


def test_what_the_latent_import_does_not_take_is_refused_by_name(checkpoints, tmp_path):
    def edited(name, change):
        target = tmp_path / name
        shutil.copytree(checkpoints["v3"], target)
        data = json.loads((target / "config.json").read_text())
        change(data)
        (target / "config.json").write_text(json.dumps(data))
        return str(target)

    cases = {"num_key_value_heads 2": lambda d: d.update(num_key_value_heads=2),
             "index_topk keys": lambda d: d.update(model_type="deepseek_v32")}  # fmt: skip
    for i, (needle, change) in enumerate(cases.items()):
        with pytest.raises(UsageError, match=needle):
            import_weights(edited(f"c{i}", change), layer=0)
