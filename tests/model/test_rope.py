"""The rope table and the rotation against transformers' own (modeling_rope_utils.ROPE_INIT_FUNCTIONS,
the Phi-3 rotary embedding with its longrope switch, apply_rotary_pos_emb of Phi-3 and GLM), and the
other modern-LLM terms against the transformers code they come from (Qwen3's q/k RMSNorm, Gemma 2's
soft-capped eager attention, gpt-oss's sinks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as HF_ROPE  # noqa: E402
from transformers.models.gemma2 import modeling_gemma2  # noqa: E402
from transformers.models.glm import modeling_glm  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

from attnx.model import AttentionConfig, build_module, reference_attention  # noqa: E402
from attnx.model.rope import parse_rope, rope_frequencies, uses_long_factors  # noqa: E402
from attnx.model.terms import TERMS  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
HEAD_DIM, ROT_DIM, THETA, ORIGINAL = 32, 16, 1000.0, 64
SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 16.0,
                    "beta_slow": 2.0, "mscale": 0.7, "mscale_all_dim": 1.0, "truncate": False},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(ROT_DIM // 2)],
                 "long_factor": [2.0 + 0.5 * i for i in range(ROT_DIM // 2)],
                 "original_max_position_embeddings": ORIGINAL, "factor": 4.0},
}  # fmt: skip


def _hf_config(scaling: dict | None) -> transformers.LlamaConfig:
    """A config transformers' rope code reads (Llama's accepts every rope type; Phi-3's rotary
    embedding class, used for its partial rotary and longrope switch, reads it alike)."""
    params = {"rope_type": "default", **(scaling or {})}
    return transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=4, head_dim=HEAD_DIM,
        max_position_embeddings=4 * ORIGINAL,
        rope_parameters={"rope_theta": THETA, "partial_rotary_factor": ROT_DIM / HEAD_DIM, **params},
    )  # fmt: skip


def _rope(scaling: dict | None, interleaved: bool = False):
    return parse_rope({"theta": THETA, "dim": ROT_DIM, "interleaved": interleaved, "scaling": scaling}, HEAD_DIM)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_table_matches_transformers(name):
    """inv_freq and attention_factor of each row, short and long sets of longrope, against
    transformers' init functions (float32 there: agreement to its rounding)."""
    scaling, hf_config = SCALINGS[name], _hf_config(SCALINGS[name])
    for seq_len in (None, ORIGINAL + 1):
        if scaling is None:
            inv, factor = modeling_phi3.Phi3RotaryEmbedding.compute_default_rope_parameters(hf_config)
        else:
            inv, factor = HF_ROPE[scaling["rope_type"]](hf_config, "cpu", seq_len=seq_len)
        ours, our_factor = rope_frequencies(_rope(scaling), seq_len)
        assert ours.shape == (ROT_DIM // 2,)
        np.testing.assert_allclose(ours, inv.double().numpy(), rtol=4 * EPS32, atol=0)
        assert our_factor == pytest.approx(factor, rel=1e-12)


def _hf_rotate(scaling: dict | None, interleaved: bool, q: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    """transformers' rotation: Phi-3's rotary embedding (cos/sin, longrope's switch) and Phi-3's
    (pairs (i, i + dim/2)) or GLM's (pairs (2i, 2i + 1)) apply_rotary_pos_emb, partial rotary both."""
    emb = modeling_phi3.Phi3RotaryEmbedding(_hf_config(scaling))
    cos, sin = emb(q, torch.from_numpy(positions))
    apply = modeling_glm.apply_rotary_pos_emb if interleaved else modeling_phi3.apply_rotary_pos_emb
    return apply(q, q, cos.double(), sin.double())[0].numpy()  # q: (B, heads, T, hd)


@pytest.mark.parametrize(
    ("name", "interleaved"),
    [("default", False), ("default", True), ("llama3", False), ("yarn", True), ("longrope", False), ("linear", True)],
)
def test_rotation_matches_transformers(name, interleaved):
    """The reference's and the torch module's rotation of q against transformers' at positions of a
    left-padded batch, past the original length too (longrope then takes its long factors)."""
    scaling = SCALINGS[name]
    rng = np.random.default_rng(0)
    B, H, T = 2, 2, 7
    q = rng.standard_normal((B, H, T, HEAD_DIM))
    config = AttentionConfig(d_model=H * HEAD_DIM, n_heads=H, causal=True, rope=_rope(scaling, interleaved))
    module = build_module(config).double()
    for positions in (np.array([[0, 1, 2, 3, 4, 5, 6], [1, 1, 0, 1, 2, 3, 4]]), np.arange(B * T).reshape(B, T) + 60):
        want = _hf_rotate(scaling, interleaved, torch.from_numpy(q), positions)
        # the angles are float32 in transformers: |d theta| <= eps32 * position * inv_freq (tolerance table)
        bound = 4 * EPS32 * (positions.max() * rope_frequencies(config.rope)[0].max() + 4) * np.abs(q).max()
        heads = q.transpose(0, 2, 1, 3)  # (B, T, H, hd): per head, as the reference's q/k terms take it
        ref, _ = TERMS["rope"].reference(config, {}, heads, heads, positions, np.arange(T))
        np.testing.assert_allclose(ref.transpose(0, 2, 1, 3), want, rtol=0, atol=bound)
        cos, sin = module._rope_cos_sin(torch.from_numpy(positions), torch.float64)
        turned = module._rotate(torch.from_numpy(q).transpose(1, 2), cos, sin).transpose(1, 2).numpy()
        np.testing.assert_allclose(turned, want, rtol=0, atol=bound)


def test_longrope_switch_is_transformers_rule():
    """Long factors for the whole call once its largest position + 1 exceeds the original length:
    at max position ORIGINAL - 1 the short set, at ORIGINAL the long set, for every token (the
    early ones included), as transformers' Phi-3 rotary embedding does."""
    rope = _rope(SCALINGS["longrope"])
    short, long = rope_frequencies(rope)[0], rope_frequencies(rope, ORIGINAL + 1)[0]
    emb = modeling_phi3.Phi3RotaryEmbedding(_hf_config(SCALINGS["longrope"]))
    x = torch.zeros(1, 1, 1, HEAD_DIM)
    for last, want in ((ORIGINAL - 1, short), (ORIGINAL, long)):
        positions = np.array([[0, 1, last]])
        assert uses_long_factors(rope, positions) == (want is long)
        cos = emb(x, torch.from_numpy(positions))[0][0, 1, : ROT_DIM // 2].double().numpy()  # position 1
        np.testing.assert_allclose(cos, np.cos(want) * rope_frequencies(rope)[1], rtol=0, atol=8 * EPS32)


def test_qk_norm_matches_qwen3_rmsnorm():
    rng = np.random.default_rng(1)
    config = AttentionConfig(d_model=64, n_heads=4, qk_norm={"eps": 1e-6})
    weight = rng.uniform(0.5, 1.5, 16).astype(np.float32)
    norm = modeling_qwen3.Qwen3RMSNorm(16, eps=1e-6)
    norm.weight.data = torch.from_numpy(weight)
    u = rng.standard_normal((2, 5, 64)).astype(np.float32)
    with torch.no_grad():
        want = norm(torch.from_numpy(u).view(2, 5, 4, 16)).reshape(2, 5, 64).numpy()
    heads = u.astype(np.float64).reshape(2, 5, 4, 16)
    got, _ = TERMS["qk_norm"].reference(config, {"q_norm.weight": weight, "k_norm.weight": weight}, heads, heads, None, np.arange(heads.shape[1]))
    got = got.reshape(2, 5, 64)
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * EPS32 * np.abs(want).max())


def _identity_weights(config: AttentionConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Projections that are the identity: the reference then computes the core on q = k = v = x."""
    eye = np.eye(config.d_model, dtype=np.float32)
    weights = {f"{n}_proj.weight": eye for n in ("q", "k", "v", "out")}
    if config.sinks:
        weights["sinks"] = rng.uniform(-2, 2, config.n_heads).astype(np.float32)
    return weights


def _hf_core(eager, config, weights, x, extra) -> np.ndarray:
    """A transformers eager_attention_forward on heads of x (float64), with the causal and window mask."""
    B, T, _ = x.shape
    h = torch.from_numpy(x).view(B, T, config.n_heads, config.head_dim).transpose(1, 2)  # (B, N, T, hd)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    hidden = (j > i) | ((i - j >= config.sliding_window) if config.sliding_window else False)
    mask = torch.from_numpy(np.where(hidden, np.finfo(np.float64).min, 0.0))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.head_dim = 1, False, config.head_dim
    if config.sinks:
        module.sinks = torch.nn.Parameter(torch.from_numpy(weights["sinks"]).double())
    out, _ = eager(module, h, h, h, mask, scaling=config.softmax_scale, dropout=0.0, **extra)
    return out.reshape(B, T, config.d_model).detach().numpy()


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_softcap_window_and_sinks_match_transformers(family):
    """The reference's core (identity projections) against Gemma 2's eager attention (softcap after
    the scale, before the masks; a sliding window) and gpt-oss's (a sink logit per head, no value)."""
    rng = np.random.default_rng(2)
    if family == "gemma2":
        config = AttentionConfig(
            d_model=32, n_heads=2, bias=False, causal=True, sliding_window=3, softcap=1.5, scale=0.7
        )
        eager, extra = modeling_gemma2.eager_attention_forward, {"softcap": config.softcap}
    else:
        config = AttentionConfig(d_model=32, n_heads=2, bias=False, causal=True, sliding_window=4, sinks=True)
        eager, extra = modeling_gpt_oss.eager_attention_forward, {}
    weights = _identity_weights(config, rng)
    x = 2 * rng.standard_normal((2, 9, config.d_model))
    want = _hf_core(eager, config, weights, x, extra)
    # Gemma 2's eager softmax runs in float32 whatever the input: agreement to float32's rounding
    atol = 16 * EPS32 * np.abs(want).max() if family == "gemma2" else 1e-12
    np.testing.assert_allclose(reference_attention(config, weights, x), want, rtol=0, atol=atol)
