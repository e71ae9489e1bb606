"""The audit's caches as its blocks declare them: a block's empty past keys and values each of its own head size
(a value's is v_head_dim), and the whole model's decoding feeding each cache input the present output its block
writes (WholeModel.presents, as read_blocks recorded it), not a name guessed by rule."""

from __future__ import annotations

import types

import numpy as np

from attnx.model import AttentionConfig
from attnx.workflows.audit.report import AuditReport
from attnx.workflows.audit.run import decode_steps, empty_cache
from attnx.workflows.audit.shapes import Shapes


def test_a_blocks_empty_cache_has_its_values_own_head_size():
    config = AttentionConfig(d_model=64, n_heads=4, n_kv_heads=2, head_dim=24, v_head_dim=16)
    key, value = empty_cache(types.SimpleNamespace(config=config, cache_capacity=3, cache_sizes=None), 2)
    assert key.shape == (2, 2, 3, 24) and value.shape == (2, 2, 3, 16)


class _Runner:
    """A whole model whose presents are named unlike its pasts: each step returns them, one token longer."""

    inputs = [types.SimpleNamespace(name=n, dtype="fp32") for n in ("input_ids", "cache_k.0", "cache_v.0")]

    def __init__(self) -> None:
        self.fed: list[dict[str, np.ndarray]] = []

    def run(self, feeds):
        self.fed.append(feeds)
        tokens = feeds["input_ids"].shape[1]
        return {"logits": np.zeros(1), "out_k.0": np.pad(feeds["cache_k.0"], ((0, 0), (0, 0), (0, tokens), (0, 0))),
                "out_v.0": np.pad(feeds["cache_v.0"], ((0, 0), (0, 0), (0, tokens), (0, 0)))}  # fmt: skip


def test_the_whole_models_decoding_feeds_each_cache_the_present_its_block_writes():
    caches = {"cache_k.0": (2, 0, 24), "cache_v.0": (2, 0, 16)}
    report = AuditReport("m.onnx", None, [], [])
    runner = _Runner()
    decode_steps(runner, caches, {"cache_k.0": "out_k.0", "cache_v.0": "out_v.0"}, Shapes(2, 5, 3), report)
    assert report.not_checked == [] and report.findings == []
    assert [f["cache_k.0"].shape[2] for f in runner.fed] == [0, 3, 4]  # the prefill, then each step's grown cache
    assert [f["cache_v.0"].shape[3] for f in runner.fed] == [16] * 3
    unpaired = AuditReport("m.onnx", None, [], [])
    decode_steps(_Runner(), caches, {"cache_k.0": "out_k.0"}, Shapes(2, 5, 3), unpaired)  # no present for values
    assert unpaired.not_checked and "cache_v.0" in unpaired.not_checked[0]


def test_a_fixed_sequence_rules_out_decoding_only_in_a_model_that_decodes():
    """Shapes.not_applicable(decoding=...): a model without a cache has no decoding check to rule out (told by the
    flag, not by reading its lines)."""
    fixed = Shapes(2, 12, None, {"sequence": "input input_ids [2, 12]"})
    assert [line.split(":")[0] for line in fixed.not_applicable()] == ["decoding step by step"]
    assert fixed.not_applicable(decoding=False) == []
