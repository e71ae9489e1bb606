"""Why a block was not read is typed (attnx.export.cores.Unread: its kind and term), and the audit and optimize
branch on the kind, never on the text: a rope table no form of rope fits is held to the checkpoint's layer, which
states the rope; any other reason keeps the block unread, checkpoint or not. No graph is run: each block is made
unread by hand and stops at its dtype (a bf16 block), the first check after the reading's."""

from __future__ import annotations

import types

import numpy as np

from attnx.export.cores import Block, Unread, UnreadKind
from attnx.export.terms import Reading, RopeReading
from attnx.workflows.audit.audit import audit_block
from attnx.workflows.rewrite.plan import plan_block
from attnx.workflows.rewrite.report import BlockRewrite

# the text says "rope" in both: only the kind tells them apart
UNFIT = Unread("rope a table no theta fits", UnreadKind.UNFIT_TABLE, "rope")
OTHER = Unread("rope its rotary tables not read: position_ids not fed", term="rope")
TABLES = (np.ones((4, 2)), np.zeros((4, 2)))  # a rotary table read from the graph (its values do not matter here)
CHECKPOINT = types.SimpleNamespace(reach=None, rope_original=None, pair=lambda weights: None, label="checkpoint")


def _block(unread: Unread) -> Block:
    # bf16: the first check after the reading's refuses it, so what stopped the block is visible
    return Block(0, "attn", "decomposed", unread=unread, dtype="bf16", reading=Reading(rope=RopeReading(tables=TABLES)))


def test_the_kind_not_the_text_is_what_holds_a_block_to_its_checkpoint():
    assert str(UNFIT) == "rope a table no theta fits" and UNFIT.kind is not OTHER.kind
    assert _block(UNFIT).to_dict()["unread"] == "rope a table no theta fits"


def test_optimize_holds_an_unfit_rope_to_the_checkpoint_and_keeps_any_other_unread_block():
    def kept(unread: Unread, source: object) -> str | None:
        rewrite = BlockRewrite(0, "attn", "decomposed")
        assert plan_block(_block(unread), rewrite, source, graph=None) is None
        return rewrite.kept

    assert kept(UNFIT, CHECKPOINT) == "a bf16 block: attnx proves fp32 and fp16 blocks"  # read on, to its dtype
    assert kept(UNFIT, None) == f"not read: {UNFIT}"  # nothing states its rope
    assert kept(OTHER, CHECKPOINT) == f"not read: {OTHER}"


def test_the_audit_holds_an_unfit_rope_to_the_checkpoint_and_names_any_other_unread_block():
    def not_checked(unread: Unread, source: object) -> list[str]:
        return audit_block(None, _block(unread), source, ["ort-cpu"], []).not_checked

    assert not_checked(UNFIT, CHECKPOINT) == ["block 0: a bf16 block: the audit feeds fp32 and fp16 blocks"]
    other = not_checked(OTHER, CHECKPOINT)
    assert other[0] == f"block 0: {OTHER}: the block is held to the checkpoint's layer by its numbers alone"
    assert not_checked(UNFIT, None) == [f"block 0: {UNFIT}: not run without a checkpoint (give --checkpoint to hold "
                                        "it to its source's layer)"]  # fmt: skip
