"""The FLOP model against an independent count: the matmuls of the formula, shape by shape."""

from __future__ import annotations

import numpy as np
import pytest

from attnx.bench import attention_flops, gemm_flops, gemm_shape
from attnx.model import AttentionConfig, preset
from tests.conftest import CONFIGS


def counted_flops(config: AttentionConfig, batch: int, seq: int, mem_seq: int | None) -> int:
    """Run the formula with numpy and add 2*M*K*N for every matmul it does, from the shapes
    the arrays really have (not from the formula being tested)."""
    c = config
    total = 0

    def mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        nonlocal total
        out = a @ b
        batch_elems = int(np.prod(out.shape[:-2]))
        total += 2 * batch_elems * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return out

    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, seq, c.d_model))
    m = rng.standard_normal((batch, mem_seq, c.kv_dim)) if c.cross else x
    s = m.shape[1]
    q = (
        mm(x, rng.standard_normal((c.d_model, c.q_dim)))
        .reshape(batch, seq, c.n_heads, c.head_dim)
        .transpose(0, 2, 1, 3)
    )
    k = mm(m, rng.standard_normal((c.kv_dim, c.kv_q_dim))).reshape(batch, s, c.n_kv_heads, c.head_dim)
    v = mm(m, rng.standard_normal((c.kv_dim, c.kv_v_dim))).reshape(batch, s, c.n_kv_heads, c.v_head_dim)
    g = c.group_size  # query head n reads key/value head n // g: the heads repeated for the core's count
    k = np.repeat(k, g, axis=2).transpose(0, 2, 1, 3)
    v = np.repeat(v, g, axis=2).transpose(0, 2, 1, 3)
    scores = mm(q, k.transpose(0, 1, 3, 2))  # (b, N, t, s)
    z = mm(scores, v).transpose(0, 2, 1, 3).reshape(batch, seq, c.v_dim)
    mm(z, rng.standard_normal((c.v_dim, c.d_model)))
    return total


@pytest.mark.parametrize("name", ["self", "cross", "causal", "cross_kpm", "grouped"])
@pytest.mark.parametrize("batch, seq, mem_seq", [(1, 5, 9), (3, 17, 4)])
def test_flops_match_a_count_of_the_formulas_matmuls(name, batch, seq, mem_seq):
    config = CONFIGS[name] if name != "grouped" else AttentionConfig(d_model=64, n_heads=8, n_kv_heads=2, causal=True)
    assert attention_flops(config, batch, seq, mem_seq) == counted_flops(config, batch, seq, mem_seq)


def test_self_attention_ignores_mem_seq_and_cross_uses_it():
    self_cfg, cross_cfg = CONFIGS["self"], CONFIGS["cross"]
    assert attention_flops(self_cfg, 2, 8, 100) == attention_flops(self_cfg, 2, 8)
    assert attention_flops(cross_cfg, 2, 8, 100) > attention_flops(cross_cfg, 2, 8, 10)


def test_large_preset_at_seq_512_by_hand():
    # d 1024, 16 heads of 64: four 512x1024x1024 projections plus 2 * 16 * 512^2 * 128.
    expected = 4 * 2 * 512 * 1024 * 1024 + 2 * 16 * 512 * 512 * 128
    assert attention_flops(preset("large"), 1, 512) == expected


def test_gemm_is_the_models_projection():
    assert gemm_shape(preset("large")) == (512, 1024, 1024)
    assert gemm_shape(CONFIGS["cross_kpm"]) == (512, 32, 24)  # d_model -> N * head_dim
    assert gemm_flops(2, 3, 4) == 48


def test_a_past_cache_adds_its_keys_to_the_core_only():
    # a step of 1 token over 100 cached keys of the large preset: 2 * 16 heads * 1 * 100 * (64 + 64) more
    config = preset("large")
    assert attention_flops(config, 1, 1, past=100) - attention_flops(config, 1, 1) == 2 * 16 * 100 * 128
