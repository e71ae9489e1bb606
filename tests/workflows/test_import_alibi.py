"""attnx import of the ALiBi decoders (issue 30): tiny random BLOOM and MPT models (transformers, a test
extra) with head counts that are and are not powers of two, saved as checkpoints, imported, and checked
against their own transformers layer on a left-padded batch, full-sequence and as a prefill then
single-token steps; planted faults the check must catch; Falcon with alibi refused, and the facts its
refusal states held to transformers (its eager attention adds the bias twice, its sdpa once, both
scaled by 1/sqrt(head_dim)).

Cost: the checks run the source and the reference only; the full-sequence graph (torch's dynamo
exporter, seconds) is exported once, through the CLI."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from attnx.cli import main  # noqa: E402
from attnx.errors import UsageError  # noqa: E402
from attnx.model.alibi import alibi_slopes  # noqa: E402
from attnx.model.config import load_config  # noqa: E402
from attnx.model.importers import import_weights  # noqa: E402
from attnx.model.weights import load_weights  # noqa: E402
from attnx.workflows import check_against_source  # noqa: E402
from tests.workflows._checkpoints import save_wide  # noqa: E402


def _families():
    """name -> model. 4 and 6 heads for BLOOM, 4 and 12 for MPT (12: slopes of 8 and of 16 heads,
    MPT's interleaving); MPT's softmax_scale set on one of them."""
    t = transformers
    return {
        "bloom-4": lambda: t.BloomModel(t.BloomConfig(hidden_size=32, n_head=4, n_layer=2, vocab_size=64)),
        "bloom-6": lambda: t.BloomModel(t.BloomConfig(hidden_size=48, n_head=6, n_layer=2, vocab_size=64)),
        "mpt-4": lambda: t.MptModel(t.MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=16)),
        "mpt-12": lambda: t.MptModel(t.MptConfig(d_model=48, n_heads=12, n_layers=2, vocab_size=64, max_seq_len=16,
                                                 attn_config={"softmax_scale": 0.3})),
    }  # fmt: skip


FAMILIES = _families()


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """Every family saved once, weights drawn wide (std 0.5): peaked attention."""
    return save_wide(tmp_path_factory.mktemp("hf-alibi"), FAMILIES)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_agrees_with_its_source_full_sequence_and_step_by_step(decoders, name):
    """The slopes against the ones transformers builds its bias with; the source layer (transformers,
    eager) full-sequence and prefill + steps on a left-padded batch, against attnx's float64 reference."""
    result = import_weights(decoders[name], layer=1)
    c, w = result.config, result.weights
    heads = int(name.split("-")[1])
    assert c.alibi and c.causal and c.key_padding_mask and c.n_heads == heads and c.bias == name.startswith("bloom")
    assert c.scale == (0.3 if name == "mpt-12" else None)
    checks = check_against_source(result, decoders[name], (), forms=())
    assert len(checks) == 3 and all(checks), [str(c) for c in checks if not c]
    assert checks[0].name.startswith("alibi slopes vs transformers'")
    assert "full sequence" in checks[1].name and "prefill + steps" in checks[2].name
    from safetensors.numpy import load_file

    stored = load_file(f"{decoders[name]}/model.safetensors")
    hd = c.head_dim
    if name.startswith("bloom"):  # rows [n_heads, 3, head_dim]: head 0's q, k, v, then head 1's q, ...
        qkv = stored["h.1.self_attention.query_key_value.weight"]
        np.testing.assert_array_equal(w["k_proj.weight"][:hd], qkv[hd : 2 * hd])
        np.testing.assert_array_equal(w["q_proj.weight"][hd : 2 * hd], qkv[3 * hd : 4 * hd])
    else:  # q | k | v blocks
        qkv = stored["blocks.1.attn.Wqkv.weight"]
        np.testing.assert_array_equal(w["v_proj.weight"], qkv[2 * c.d_model :])


def _no_alibi(r):
    r.config = dataclasses.replace(r.config, alibi=False)


def _split_bloom_as_blocks(r):
    """BLOOM's fused rows read as q | k | v blocks (MPT's layout)."""
    n, hd, d = r.config.n_heads, r.config.head_dim, r.config.d_model
    fused = np.stack([r.weights[f"{p}_proj.weight"].reshape(n, hd, d) for p in "qkv"], 1).reshape(3 * d, d)
    for i, p in enumerate("qkv"):
        r.weights[f"{p}_proj.weight"] = fused[i * d : (i + 1) * d]


def _split_mpt_per_head(r):
    """MPT's fused rows read per head, [n_heads, 3, head_dim] (BLOOM's layout)."""
    n, hd, d = r.config.n_heads, r.config.head_dim, r.config.d_model
    fused = np.concatenate([r.weights[f"{p}_proj.weight"] for p in "qkv"]).reshape(n, 3, hd, d)
    for i, p in enumerate("qkv"):
        r.weights[f"{p}_proj.weight"] = fused[:, i].reshape(d, d)


# fault -> (family, how it is planted); the slopes' fault (bias max 4, MPT's alibi_bias_max ignored by
# transformers) is planted in attnx's slopes, which the reference and the term's table (the slopes check) read.
FAULTS = {
    "bloom alibi dropped": ("bloom-6", _no_alibi),
    "bloom rows read as q|k|v blocks": ("bloom-6", _split_bloom_as_blocks),
    "mpt rows read per head": ("mpt-12", _split_mpt_per_head),
    "mpt softmax_scale dropped": ("mpt-12", lambda r: setattr(r, "config", dataclasses.replace(r.config, scale=None))),
    "mpt slopes of bias max 4": ("mpt-12", "bias max 4"),
}  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS)
def test_a_planted_fault_fails_the_check(decoders, fault, monkeypatch):
    name, plant = FAULTS[fault]
    result = import_weights(decoders[name], layer=1)
    if plant == "bias max 4":  # 2^(-4k/n): every slope's exponent halved
        # the term's module holds both its reference function and its table (attnx.model.terms.alibi)
        monkeypatch.setattr("attnx.model.terms.alibi.alibi_slopes", lambda n: np.sqrt(alibi_slopes(n)))
    else:
        plant(result)
    slopes, *outputs = check_against_source(result, decoders[name], (), forms=())
    assert len(outputs) == 2 and not any(outputs), [str(c) for c in outputs]
    assert bool(slopes) == (plant != "bias max 4"), str(slopes)


def test_the_cli_imports_bloom_with_its_check_and_names_what_it_skips(decoders, tmp_path, capsys):
    """attnx import --check --kv-cache: the source full-sequence and step by step, the decomposed
    full-sequence graph (the torch module's export) and step model (the registry's emitter)."""
    out = tmp_path / "bloom"
    code = main(["import", decoders["bloom-6"], "--layer", "1", "--check", "--kv-cache", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "FAIL" not in text and "alibi slopes vs transformers' (bloom, 6 heads)" in text
    assert "source layer vs attnx reference, prefill + steps" in text
    assert "attnx decomposed full-sequence graph vs attnx reference" in text
    assert "attnx decomposed step model" in text and "skipped" not in text
    assert "q_proj.weight <- h.1.self_attention.query_key_value.weight (rows [n_heads, 3, head_dim]" in text
    config = load_config(out / "config.json")
    assert config.alibi and config.kv_cache and config.n_heads == 6
    weights = load_weights(out / "weights.safetensors", config)
    assert set(weights) == {f"{p}_proj.{k}" for p in ("q", "k", "v", "out") for k in ("weight", "bias")}


# Falcon -------------------------------------------------------------------------------------------
def _falcon(attn_implementation: str, heads: int = 4, head_dim: int = 8):
    t = transformers
    torch.manual_seed(1)
    model = t.FalconModel(t.FalconConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_hidden_layers=1,
                                         vocab_size=64, alibi=True, multi_query=False, new_decoder_architecture=False,
                                         parallel_attn=False, bias=True, attn_implementation=attn_implementation))  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


def _falcon_layer(model, x, mask):
    """Falcon's attention block of layer 0 on x (its input replaced by a pre-hook; no residual there)."""
    attention, got = model.h[0].self_attention, {}
    hooks = [attention.register_forward_pre_hook(lambda m, a, k: ((x, *a[1:]), k), with_kwargs=True),
             attention.register_forward_hook(lambda m, a, k, o: got.update(y=o[0]), with_kwargs=True)]  # fmt: skip
    with torch.no_grad():
        model(inputs_embeds=torch.zeros_like(x), attention_mask=mask)
    for hook in hooks:
        hook.remove()
    return got["y"].double().numpy()


def _falcon_formula(model, x, mask, times: float, heads: int, head_dim: int):
    """softmax(q.k / sqrt(hd) + times * slope (j - i) / sqrt(hd) + mask) v, float64 (Falcon's layout:
    query_key_value rows [n_heads, 3, head_dim], as BLOOM's)."""
    a = model.h[0].self_attention
    w, b = a.query_key_value.weight.detach().double().numpy(), a.query_key_value.bias.detach().double().numpy()
    xx = x.double().numpy()
    B, T, _ = xx.shape
    qkv = (xx @ w.T + b).reshape(B, T, heads, 3, head_dim)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.einsum("bind,bjnd->bnij", q, k) / math.sqrt(head_dim)
    s = s + times * alibi_slopes(heads)[:, None, None] * (j - i) / math.sqrt(head_dim)
    hidden = (j > i)[None, None] | (mask.numpy() == 0)[:, None, None, :]
    s = np.where(hidden, -1e300, s)  # finite: a padding query's row (left out of the comparison) stays finite
    p = np.exp(s - s.max(-1, keepdims=True))
    z = np.einsum("bnij,bjnd->bind", p / p.sum(-1, keepdims=True), v).reshape(B, T, -1)
    return z @ a.dense.weight.detach().double().numpy().T + a.dense.bias.detach().double().numpy()


def test_falcon_with_alibi_is_refused_and_what_its_refusal_says_holds(tmp_path):
    """transformers 5.24's Falcon: sdpa adds slope * (j - i) / sqrt(head_dim) once, eager twice
    (the model folds the bias into the mask, modeling_falcon.py:773-777, and eager adds it again at
    :394 before adding that mask at :396); neither is attnx's slope * (j - i) after the scale. 4 heads: slopes that are powers
    of two, exact in bfloat16 at these positions, so the float64 formula holds to float32 rounding."""
    heads, hd = 4, 8
    torch.manual_seed(0)
    x = torch.randn(2, 6, heads * hd)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    rows = np.ones((2, 6), bool)
    rows[0, :2] = False  # padding queries: no visible key
    for impl, once_or_twice in (("sdpa", 1), ("eager", 2)):
        model = _falcon(impl, heads, hd)
        y = _falcon_layer(model, x, mask)
        errors = {times: np.abs(y - _falcon_formula(model, x, mask, times, heads, hd))[rows].max() for times in (1, 2)}
        assert errors[once_or_twice] < 1e-4 < errors[3 - once_or_twice], (impl, errors)
        unscaled = _falcon_formula(model, x, mask, math.sqrt(hd), heads, hd)  # attnx's: slope * (j - i)
        assert np.abs(y - unscaled)[rows].max() > 1e-2
    folder = tmp_path / "falcon"
    model.save_pretrained(folder)
    with pytest.raises(UsageError, match="falcon with alibi: transformers' Falcon adds its ALiBi bias before the scale"):
        import_weights(str(folder))
    assert json.loads((folder / "config.json").read_text())["alibi"] is True
