"""A whole DeepSeek-V3 decoder exported by torch.onnx (tests/fixtures/exported/make_mla.py: transformers 5.24, q through
q_lora_rank, its rope read in pairs, its cache MLA's latent: the compressed kv and the rope key) through `attnx audit`:
each block's multi-head latent attention read (attnx.export.cores._latent_block) and proven against the float64
formula; a block turned otherwise than it is read fails its proof; one the latent term cannot state is named."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from attnx.cli import main
from attnx.workflows.audit.audit import audit_model

HERE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "exported", "torch-dynamo", "deepseek_v3")
MODEL, CHECKPOINT = os.path.join(HERE, "sdpa", "model.onnx"), os.path.join(HERE, "checkpoint")


@pytest.fixture(scope="module")
def report():
    return audit_model(MODEL)


def test_every_mla_block_is_read_as_latent_attention_and_proven(report):
    assert report.passed and not report.unread
    assert [b.index for b in report.blocks] == [0, 1]
    for block in report.blocks:
        assert "latent" in block.terms and "rope" in block.terms
        names = [c.name for c in block.checks]
        assert any(n.startswith("full sequence") for n in names) and any(n.startswith("prefill") for n in names)
        assert all(block.checks) and not block.findings and not block.not_checked


def _producers(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in model.graph.node for o in n.output}


def test_a_rope_key_turned_with_its_halves_swapped_fails_the_proof(tmp_path):
    model = onnx.load(MODEL)
    made = _producers(model)
    turned = made[made["present.0.value"].input[1]]  # Concat(x1 cos - x2 sin, x2 cos + x1 sin): the turned key
    assert turned.op_type == "Concat"
    turned.input[0], turned.input[1] = turned.input[1], turned.input[0]
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    faulty = audit_model(str(path), layers=[0])
    assert not faulty.passed
    assert faulty.blocks[0].findings and not all(faulty.blocks[0].checks)
    assert any("against the reference fails" in f for f in faulty.blocks[0].findings)


def test_a_block_whose_two_norms_differ_in_eps_is_named_not_read(tmp_path):
    model = onnx.load(MODEL)
    made = _producers(model)
    weight = "model.layers.0.self_attn.q_a_layernorm.weight"  # both layers' (ones: one initializer)
    norm = [n for n in model.graph.node if weight in n.input][1]  # block 1's q_a_layernorm
    value = next(i for i in norm.input if i != weight)
    while made[value].op_type != "Add":  # back through the Muls, Reciprocal and Sqrt to the Add of eps
        value = next(i for i in made[value].input if i in made and made[i].op_type in ("Mul", "Reciprocal",
                                                                                         "Sqrt", "Add"))  # fmt: skip
    add = made[value]
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1e-3, np.float32), "q_a_eps"))
    add.input[1] = "q_a_eps"
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    found = audit_model(str(path))
    assert [b.index for b in found.blocks] == [0] and found.blocks[0].passed
    assert len(found.unread) == 1 and not found.passed
    assert "q_a_layernorm's eps" in found.unread[0] and "latent term has one" in found.unread[0]


def test_each_block_pairs_with_its_checkpoint_layer_and_states_what_it_imports(capsys):
    # the layers sampled by o_proj alone (a latent layer has no q, k, v projections); the terms and weights read
    # from the graph are the ones `attnx import` reads from the checkpoint: no finding
    assert main(["audit", MODEL, "--checkpoint", CHECKPOINT]) == 0
    out = capsys.readouterr().out
    assert "block 0 = checkpoint layer 0: pass" in out and "block 1 = checkpoint layer 1: pass" in out


def test_a_plain_q_half_split_eager_export_is_read_and_pairs_with_its_checkpoint(capsys):
    """The other variant of make_mla.py: q from a plain q_proj, half-split pairs (rotate_half: a Concat before the
    Mul by sin), v heads of 12, eager attention. k's path ends at the rope key's projection there, not kv_b_proj's:
    the block is told by v's widening projection; before, it was "a cross attention", not read."""
    model, checkpoint = os.path.join(HERE, "eager-plain-q", "model.onnx"), os.path.join(HERE, "checkpoint-plain-q")
    assert main(["audit", model, "--checkpoint", checkpoint]) == 0
    out = capsys.readouterr().out
    assert "block 0 = checkpoint layer 0: pass" in out and "block 1 = checkpoint layer 1: pass" in out
    assert "latent,rope" in out


PLAIN_Q = os.path.join(HERE, "eager-plain-q", "model.onnx"), os.path.join(HERE, "checkpoint-plain-q")


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """Both exports optimized against their checkpoints (which bound the times to 128 positions): model -> (report,
    the written model's path)."""
    from attnx.workflows.rewrite import optimize_model

    out = {}
    for name, (model, checkpoint) in {"sdpa": (MODEL, CHECKPOINT), "eager-plain-q": PLAIN_Q}.items():
        path = str(tmp_path_factory.mktemp(name) / "out.onnx")
        out[name] = optimize_model(model, path, checkpoint=checkpoint), path
    return out


@pytest.mark.parametrize("name", ["sdpa", "eager-plain-q"])
def test_optimize_writes_each_mla_block_as_the_absorbed_latent_step_and_proves_it(optimized, name):
    """No fused kernel computes the latent: each block is written by the decomposed core (plan.LOWERINGS_TRIED), its
    step absorbed (q.k and p.v over the latents, never expanded by kv_b_proj), the graph's two cache tensors joined
    into its latent and its present split back under their own names; read back and held to the checkpoint."""
    report, path = optimized[name]
    assert report.passed and report.written, report.proofs
    assert [(b.written, b.repairs) for b in report.blocks] == [("decomposed", [])] * 2
    said = [str(p) for p in report.proofs]
    assert sum(line.startswith("pass: block") and "against the float64 reference and the checkpoint" in line
               for line in said) == 2  # fmt: skip
    assert any(line.startswith("pass: the whole model, prefill + steps") for line in said)
    written, given = onnx.load(path), onnx.load(MODEL if name == "sdpa" else PLAIN_Q[0])
    assert [i.name for i in written.graph.input] == [i.name for i in given.graph.input]
    assert [o.name for o in written.graph.output] == [o.name for o in given.graph.output]
    made = _producers(written)
    for layer in (0, 1):  # the latent [rope key | compressed kv] from the graph's value and key, and back
        joined = made[f"attnx/block{layer}/past_latent"]
        assert joined.op_type == "Concat" and list(joined.input) == [f"past_key_values.{layer}.value",
                                                                     f"past_key_values.{layer}.key"]  # fmt: skip
        for part in ("key", "value"):
            assert made[f"present.{layer}.{part}"].op_type == "Slice"
    # absorbed: kv_b_proj's halves are [heads, nope, rank] and [heads, rank, v] constants, no 2-D kv_b_proj MatMul
    kv_b = [t for t in written.graph.initializer if "kv_b_proj" in t.name]
    assert kv_b and all(len(t.dims) == 3 for t in kv_b)


def test_a_written_absorbed_block_whose_w_uv_differs_is_found_against_the_checkpoint(optimized, tmp_path):
    """The reader rebuilds kv_b_proj from the absorbed halves: a changed W_uv in block 1 is named against layer 1."""
    model = onnx.load(optimized["sdpa"][1])
    w_uv = next(t for t in model.graph.initializer if t.name.startswith("attnx/block1/") and "v_half" in t.name)
    w_uv.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(w_uv) * 1.01, w_uv.name))
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    found = audit_model(str(path), checkpoint=CHECKPOINT)
    assert not found.passed
    assert not found.blocks[0].findings and any("kv_b_proj" in f for f in found.blocks[1].findings)


def test_a_fault_in_the_prompts_branch_alone_is_found(optimized, tmp_path):
    """The written step takes an If: the expanded heads for a prompt, the absorbed ones for a step. The reader reads
    the absorbed branch, and the block's checks run both: W_uv 1% off in block 1's expanded branch alone (the
    absorbed one reads the true W_uv) fails its full-sequence check; block 0 passes."""
    model = onnx.load(optimized["sdpa"][1])
    (switch,) = [n for n in model.graph.node if n.op_type == "If" and n.name.startswith("attnx/block1/")]
    expanded = next(a.g for a in switch.attribute if a.name == "then_branch")
    assert expanded.name == "expanded"
    w_uv = next(t for t in model.graph.initializer if t.name.startswith("attnx/block1/") and "v_half" in t.name)
    faulty = onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(w_uv) * 1.01, f"{w_uv.name}/faulty")
    model.graph.initializer.append(faulty)
    uses = [n for n in expanded.node if w_uv.name in n.input]
    assert len(uses) == 1
    uses[0].input[list(uses[0].input).index(w_uv.name)] = faulty.name
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    found = audit_model(str(path))
    assert found.blocks[0].passed and not found.blocks[1].passed
    failing = [c.name for c in found.blocks[1].checks if not c]
    assert any(name.startswith("full sequence") for name in failing), failing


def test_build_model_serves_the_latent_in_the_buffer_form_and_generate_writes_it_in_place(tmp_path):
    """attnx build --model of the DeepSeek-V3 export: each block written again in the buffer form by the decomposed
    core's emitter (no fused core computes the latent), its cache one latent buffer a layer, written in place by
    TensorScatter; generate's rows of other lengths, three at once, the same tokens as the model's own I/O one at a
    time; a prompt writes its row's first positions of the buffer the engine allocated, and nothing else."""
    import json

    from attnx.runtimes.base import ModelSource, create_runner
    from attnx.runtimes.generate import Engine, Request
    from attnx.workflows import build_model_package

    out = tmp_path / "pkg"
    build_model_package(MODEL, out, checkpoint=CHECKPOINT)
    decode = json.loads((out / "manifest.json").read_text())["decode"]
    assert decode["file"] == "decode.onnx" and decode["cores"] == ["decomposed", "decomposed"]
    graph = onnx.load(out / "decode.onnx", load_external_data=False).graph
    assert [i.name for i in graph.input if i.name.startswith("past")] == [f"past_key_values.{n}.latent" for n in (0, 1)]
    assert sum(n.op_type == "TensorScatter" for n in graph.node) == 2
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(1, 64, n)] for n in (7, 3, 12, 5)]
    tokens = {}
    for name, batch in (("decode.onnx", 3), ("model.onnx", 1)):
        with create_runner("ort-cpu", ModelSource(model_path=str(out / name))).load() as runner:
            engine = Engine(runner, max_batch=batch, context=128)
            requests = [Request(i, p, 6) for i, p in enumerate(prompts)]
            if name == "decode.onnx":
                cache = engine._cache(requests[:2])
                assert [b.shape for b in cache.buffers] == [(2, 1, 13, 24)] * 2  # 7 + 6 positions of [rope | kv]
                cache.prefill(requests[0])
                for buffer in cache.buffers:
                    assert np.abs(buffer[0, 0, :7]).max(axis=-1).all() and not buffer[0, 0, 7:].any()
                    assert not buffer[1].any()
            engine.run(requests)
        tokens[name] = [r.tokens for r in requests]
    assert tokens["decode.onnx"] == tokens["model.onnx"] and all(len(t) == 6 for t in tokens["model.onnx"])


def test_an_mla_block_with_int4_projections_takes_them_as_they_are(tmp_path):
    """--weights int4: the latent core writes its own projections, so it takes the graph's MatMulNBits of each as
    they are (the same tensors and attributes; kv_b_proj folded into the absorbed halves from its dequantized
    weights), never bound at the per-head tensors a reading of its k and v met (which computed other numbers: a
    proof failing by 3.9e-4 on a tiny GLM-4.7-Flash). Proven against float64 and the whole model's twins."""
    from attnx.workflows import optimize_model

    out = tmp_path / "out.onnx"
    report = optimize_model(MODEL, out, weights="int4", checkpoint=CHECKPOINT, serve=True)
    assert report.passed and report.written, [str(p) for p in report.proofs]
    # what the form served is written from again: each plan's MatMulNBits as read, the splice leaving them as they are
    for plan in report.served[1]:
        assert sorted(plan.nbits) == ["kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "out_proj.weight",
                                      "q_a_proj.weight", "q_b_proj.weight"]  # fmt: skip
        assert all(sorted(own) == ["attributes", "inputs"] for own in plan.nbits.values())
    assert [(b.written, b.kept) for b in report.blocks] == [("decomposed", None)] * 2
    said = [str(p) for p in report.proofs]
    assert sum(line.startswith("pass: block") for line in said) == 2
    assert any(line.startswith("pass: the whole model (each with its MatMulNBits computing in float32") for line in said)
    written = onnx.load(out, load_external_data=False)
    ops = [n.op_type for n in written.graph.node]
    # per layer: q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj as int4 (kv_b_proj folded), 3 MLP; and the LM head
    assert ops.count("MatMulNBits") == 2 * (4 + 3) + 1 and "MatMul" not in ops and ops.count("If") == 2
    floats = {t.name for t in written.graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) > 1
              and not t.name.endswith("_scales")}  # the blocks' scales: MatMulNBits's and the embeddings'  # fmt: skip
    assert floats == {f"attnx/block{i}/kv_b_proj.{half}" for i in (0, 1) for half in ("k_half", "v_half.T")}


def test_build_model_weights_int4_serves_the_latent_with_its_int4_projections(tmp_path):
    """build --model --weights int4: the buffer form written with the graph's MatMulNBits (q_a and kv_a packed, as
    the served form packs what reads one input), its tensors the package's own entries; verify replays the golden
    generations."""
    import json

    from attnx.runtimes.package import verify_package
    from attnx.workflows import build_model_package

    out = tmp_path / "pkg"
    build_model_package(MODEL, out, checkpoint=CHECKPOINT, weights="int4")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["decode"]["cores"] == ["decomposed", "decomposed"] and manifest["optimize"]["weights"]
    graph = onnx.load(out / "decode.onnx", load_external_data=False).graph
    assert sum(n.op_type == "TensorScatter" for n in graph.node) == 2 and any(n.op_type == "MatMulNBits"
                                                                              for n in graph.node)  # fmt: skip
    assert not [t.name for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > 4096]
    assert verify_package(str(out)).passed


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    from attnx.export import save_model
    from attnx.workflows.rewrite.weights import quantize_weights_file

    path, _ = quantize_weights_file(MODEL, MODEL, "int4", str(tmp_path_factory.mktemp("int4")), save_model)
    return path


def test_an_int4_mla_export_audits_as_its_float32_twin_and_says_so(int4_model):
    """At accuracy_level 4 MatMulNBits also rounds q_b_proj's and kv_b_proj's inputs to int8, which no error model
    follows yet (held as the per-head blocks' x and z are, each block failed by 3-6x its bound): each block is
    checked with float32 compute, the gap named; against the checkpoint each weight, kv_a_proj_with_mqa's too, within
    its 4-bit step."""
    for checkpoint in (None, CHECKPOINT):
        report = audit_model(int4_model, checkpoint=checkpoint)
        assert report.passed and [b.index for b in report.blocks] == [0, 1]
        for block in report.blocks:
            assert all(block.checks) and not block.findings
            assert len(block.not_checked) == 1 and "checked with its MatMulNBits computing in float32" in \
                block.not_checked[0]


def test_an_int4_mla_weight_off_by_more_than_its_step_is_found_against_the_checkpoint(int4_model, tmp_path):
    model = onnx.load(int4_model)
    widths = {n.name: next(a.i for a in n.attribute if a.name == "N") for n in model.graph.node
              if n.op_type == "MatMulNBits"}  # fmt: skip
    # layer 0's kv_a_proj_with_mqa: [compressed kv (16) | rope key (8)], the one projection 24 wide
    node = next(n for n in model.graph.node if widths.get(n.name) == 24)
    scales = next(t for t in model.graph.initializer if t.name == node.input[2])
    values = onnx.numpy_helper.to_array(scales).copy()
    values.flat[0] *= 2  # one block of one output channel twice as large
    scales.CopyFrom(onnx.numpy_helper.from_array(values, scales.name))
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    report = audit_model(str(path), checkpoint=CHECKPOINT, layers=[0])
    assert not report.passed
    assert any("kv_a_proj_with_mqa.weight differs from the checkpoint's by more than its 4-bit step" in f
               for f in report.blocks[0].findings)
