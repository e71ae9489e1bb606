"""attnx import against the models themselves: tiny random Hugging Face models of every family
(transformers, a test extra), saved as checkpoints, imported layer by layer, exported in each
lowering, and checked against the source module with padding and causal masks."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from attnx.cli import main  # noqa: E402
from attnx.errors import WeightsError  # noqa: E402
from attnx.model.importers import import_weights  # noqa: E402
from attnx.workflows import check_against_source, import_model  # noqa: E402
from tests.workflows._checkpoints import save_wide  # noqa: E402

LOWERINGS = ("decomposed", "onnx", "ort-fused")
SMALL = dict(vocab_size=64, max_position_embeddings=64)


def _models():
    t = transformers
    return {
        "bert": lambda: t.BertModel(t.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                                 intermediate_size=37, **SMALL)),
        "roberta": lambda: t.RobertaModel(t.RobertaConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                                          intermediate_size=37, pad_token_id=1, **SMALL)),
        "vit": lambda: t.ViTModel(t.ViTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                              intermediate_size=37, image_size=8, patch_size=4)),
        "gpt2": lambda: t.GPT2Model(t.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=64, n_positions=64,
                                                 bos_token_id=0, eos_token_id=0)),
        "bart": lambda: t.BartModel(t.BartConfig(d_model=32, encoder_attention_heads=4, decoder_attention_heads=2,
                                                 encoder_layers=2, decoder_layers=2, encoder_ffn_dim=37,
                                                 decoder_ffn_dim=37, **SMALL)),
        "whisper": lambda: t.WhisperModel(t.WhisperConfig(d_model=32, encoder_attention_heads=4,
                                                          decoder_attention_heads=4, encoder_layers=2, decoder_layers=2,
                                                          encoder_ffn_dim=37, decoder_ffn_dim=37, vocab_size=64,
                                                          num_mel_bins=8, max_source_positions=16,
                                                          max_target_positions=16, pad_token_id=1, bos_token_id=1,
                                                          eos_token_id=2, decoder_start_token_id=3)),
        "t5": lambda: t.T5Model(t.T5Config(d_model=32, d_kv=8, num_heads=4, num_layers=2, d_ff=37, vocab_size=64)),
    }  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every family saved as a checkpoint, weights drawn wide (std 0.5, not the 0.02 of a fresh
    model): peaked attention, so that a q/k mix-up or a wrong scale shows in the check."""
    return save_wide(tmp_path_factory.mktemp("hf"), _models())


CASES = [("bert", "self", None), ("roberta", "self", None), ("vit", "self", None), ("gpt2", "self", None),
         ("bart", "self", "encoder"), ("bart", "self", "decoder"), ("bart", "cross", None),
         ("whisper", "self", "encoder"), ("whisper", "self", "decoder"), ("whisper", "cross", None),
         ("t5", "cross", None)]  # fmt: skip


# Cases whose imported config is another case's, field for field (only the weights differ): their exports in each
# lowering take the same path through the exporter as that case's, so they are checked against their source module
# alone, which is where the family's own mapping shows.
SAME_CONFIG = {("roberta", "self", None): "bert", ("bart", "self", "encoder"): "bert",
               ("whisper", "self", "encoder"): "vit", ("whisper", "self", "decoder"): "gpt2"}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "attention", "stack"), CASES, ids=[f"{a}-{s or 'd'}-{k}" for a, k, s in CASES])
def test_every_family_imports_exports_and_agrees_with_its_source(checkpoints, tmp_path, arch, attention, stack):
    """Every family and stack imports and agrees with its source module; each distinct config (what the exporter
    reads) is exported in every lowering and agrees there too. A case in SAME_CONFIG is held to its twin's config,
    so the twin's exports cover its path."""
    lowerings = () if (arch, attention, stack) in SAME_CONFIG else LOWERINGS
    report = import_model(checkpoints[arch], tmp_path / "out", layer=1, attention=attention, stack=stack, check=True,
                          lowerings=lowerings)  # fmt: skip
    assert report.passed and len(report.checks) == 1 + len(lowerings), [str(c) for c in report.checks]
    if (arch, attention, stack) in SAME_CONFIG:
        twin = next(c for c in CASES if c[0] == SAME_CONFIG[arch, attention, stack])
        twin_config = import_weights(checkpoints[twin[0]], layer=1, attention=twin[1], stack=twin[2]).config
        assert report.result.config == twin_config
    config = report.result.config
    assert config.causal == (attention == "self" and (arch == "gpt2" or stack == "decoder"))
    assert config.cross == (attention == "cross")
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "weights.safetensors").exists()


def test_the_check_catches_a_wrong_mapping(checkpoints):
    """q and k swapped, as a hand-written mapping might: the source disagrees."""
    result = import_weights(checkpoints["bert"], layer=1)
    w = result.weights
    w["q_proj.weight"], w["k_proj.weight"] = w["k_proj.weight"], w["q_proj.weight"]
    checks = check_against_source(result, checkpoints["bert"], lowerings=())
    assert not checks[0] and "source module" in checks[0].name


def test_a_sharded_checkpoint_imports_as_the_whole_one(checkpoints, tmp_path):
    torch.manual_seed(3)
    model = transformers.AutoModel.from_pretrained(checkpoints["bert"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    whole, sharded = import_weights(checkpoints["bert"], layer=1), import_weights(str(tmp_path / "sharded"), layer=1)
    assert whole.config == sharded.config
    assert all((whole.weights[k] == sharded.weights[k]).all() for k in whole.weights)


def test_a_pickle_checkpoint_is_refused_with_exit_2(checkpoints, tmp_path, capsys):
    """A folder holding its weights only as pytorch_model.bin (torch.save's pickle)."""
    model = transformers.AutoModel.from_pretrained(checkpoints["bert"])
    (tmp_path / "pickle").mkdir()
    model.config.save_pretrained(tmp_path / "pickle")
    torch.save(model.state_dict(), tmp_path / "pickle" / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="refused, never unpickled"):
        import_weights(str(tmp_path / "pickle"))
    assert main(["import", str(tmp_path / "pickle"), "--out", str(tmp_path / "o")]) == 2
    assert "never unpickled" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_nn_multihead_attention_imports_and_agrees(tmp_path):
    torch.manual_seed(5)
    mha = torch.nn.MultiheadAttention(32, 8, batch_first=True).eval()
    report = import_model(mha, None, key_padding_mask=True, check=True, lowerings=("ort-fused",))
    assert report.passed and report.result.config.n_heads == 8
    assert "q_proj.weight <- in_proj_weight[0:32] (rows)" in report.result.mapping
