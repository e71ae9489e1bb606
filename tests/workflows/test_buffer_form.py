"""The buffer form of a whole model (attnx.workflows.rewrite.serve) and how generate serves it
(attnx.runtimes.generate's shared cache): its inputs and outputs, the cache written in place in a row's own slot, rows
that leave replaced by the last so that the rows decoded are one block, no row's tokens depending on its batch-mates,
and a package that proves the form before it records from it (attnx.workflows._buffer_form); a model the form does
not fit said why, and served through its own inputs and outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from attnx.errors import InputError
from attnx.model.tolerance import ProblemSize, whole_model_tolerance
from attnx.runtimes.base import ModelSource, create_runner
from attnx.runtimes.compare import compare_arrays
from attnx.runtimes.generate import Engine, Request
from attnx.runtimes.model_package import served_model
from attnx.workflows import build_model_package, optimize_model
from attnx.workflows._buffer_form import BufferFormResult, prove_buffer_form, write_buffer_form
from attnx.workflows.rewrite.prove import longest_reduction
from attnx.workflows.rewrite.serve import NotBufferable, splice_served

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EXPORT = FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"
CHECKPOINT = FIXTURES / "genai" / "llama" / "checkpoint"


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "pkg"
    build_model_package(str(EXPORT), out, checkpoint=str(CHECKPOINT))
    return out


def _runner(path: Path):
    return create_runner("ort-cpu", ModelSource(model_path=str(path))).load()


def _prompts(lengths, seed=3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 256, n)] for n in lengths]


def _logits(request: Request) -> np.ndarray:
    return np.concatenate([request.logits[0], np.stack(request.logits[1:])])


def test_the_buffer_form_takes_each_rows_length_and_no_padding_mask(package):
    """Its inputs and outputs; each block written by GroupQueryAttention's own buffer-form emitter (the first core that
    reads each row's length), rotating q and k itself from one table of the context's 128 positions for both blocks;
    and the serving passes: the 5 RMS norms fused, 4 of them with the residual add before them, each MLP's gate/up
    projections one MatMul (the core packs its q/k/v itself: 9 MatMuls), the logits of the last position alone
    (the golden generations record a prompt's there)."""
    manifest = json.loads((package / "manifest.json").read_text())
    assert manifest["decode"]["cores"] == ["gqa", "gqa"]
    assert manifest["decode"]["notes"] == [
        "2 block(s) written in the buffer form by their core's emitter (gqa): the cache in place, each row its own "
        "length",
        "5 RMS norm(s) fused into SimplifiedLayerNormalization",
        "4 residual add(s) fused into their norm (SkipSimplifiedLayerNormalization)",
        "4 MatMuls packed into 2 (groups of [2])",
        "logits: the last position's alone (the head computed for one position)"]  # fmt: skip
    assert manifest["generations"]["prompt_logits"] == "last"
    model = ir.load(package / "decode.onnx")
    cores = [n for n in model.graph if n.op_type == "GroupQueryAttention"]
    assert len(cores) == 2 and all(n.attributes.get_int("do_rotary", 0) == 1 for n in cores)
    assert len({n.inputs[7].name for n in cores}) == 1 and cores[0].inputs[7].const_value.shape[0] == 128
    assert sum(n.op_type == "MatMul" for n in model.graph) == 9
    with _runner(package / "decode.onnx") as runner:
        inputs = {s.name: s.shape for s in runner.inputs}
        outputs = {s.name: s.shape for s in runner.outputs}
    assert "attention_mask" not in inputs
    assert inputs["seqlens_k"] == ("batch_size",) and inputs["total_sequence_length"] == ()
    for layer in range(2):  # past and present: one buffer, of the capacity the caller allocates
        for part in ("key", "value"):
            assert inputs[f"past_key_values.{layer}.{part}"] == ("batch_size", 2, "max_sequence_length", 16)
            assert outputs[f"present.{layer}.{part}"] == ("batch_size", 2, "max_sequence_length", 16)
    assert outputs["logits"] == ("batch_size", 1, 256)


def test_a_prompt_and_a_step_write_their_keys_in_place_in_the_rows_slot(package):
    """A prompt of 7 tokens prefilled into slot 0 of a buffer of 2 rows: positions 0..6 of slot 0 written, nothing
    else; one step writes position 7 in the same buffer (no copy of it: the arrays the engine allocated hold it)."""
    prompts = _prompts((7, 4))
    with _runner(package / "decode.onnx") as runner:
        engine = Engine(runner, max_batch=2, context=128)
        requests = [Request(i, p, 5) for i, p in enumerate(prompts)]
        cache = engine._cache(requests)
        assert [b.shape for b in cache.buffers] == [(2, 2, 12, 16)] * 4  # 2 rows, 7 + 5 positions
        cache.prefill(requests[0])
        cache.join(requests[0])
        for buffer in cache.buffers:
            assert np.abs(buffer[0, :, :7]).min(axis=-1).all() and not buffer[0, :, 7:].any() and not buffer[1].any()
        cache.step(np.asarray([3]))
        cache.advance()
        for buffer in cache.buffers:
            assert np.abs(buffer[0, :, 7]).min(axis=-1).all() and not buffer[0, :, 8:].any()
        assert list(cache.fed_positions()) == [8]


def test_rows_that_leave_are_replaced_and_no_row_depends_on_its_batch_mates(package):
    """Six requests of other lengths and limits, three rows at once: rows leave in the middle of the batch (the last
    row takes their slot), waiting ones join; each request's tokens are its own alone, and its logits within the
    tolerance table's whole-model bound of its own alone and of the model's own I/O (at the positions the buffer form
    computes logits for: a prompt's last, then each step's)."""
    prompts = _prompts((9, 3, 14, 5, 11, 2))
    limits = (4, 13, 6, 9, 3, 7)
    runs = {}
    for name, batch in (("decode.onnx", 3), ("decode.onnx", 1), ("model.onnx", 1)):
        requests = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, limits))]
        with _runner(package / name) as runner:
            engine = Engine(runner, max_batch=batch, context=128, record=True)
            stats = engine.run(requests)
        assert engine.io.form == ("buffer" if name == "decode.onnx" else "growing")
        assert stats.largest_batch == batch
        runs[(name, batch)] = requests
    tol, size = whole_model_tolerance("fp32", 2), ProblemSize(longest_reduction(str(package / "model.onnx")))
    mixed = runs[("decode.onnx", 3)]
    for other in (runs[("decode.onnx", 1)], runs[("model.onnx", 1)]):
        assert [r.tokens for r in mixed] == [r.tokens for r in other]
        assert [len(r.tokens) for r in mixed] == list(limits)
        for a, b in zip(mixed, other):  # the buffer form's prompt logits: its last position's alone
            assert compare_arrays("logits", _logits(a), _logits(b)[-len(_logits(a)):], tol, size)


def test_a_buffer_form_that_computes_otherwise_fails_its_proof_by_prompt_and_step(package, tmp_path):
    """The proof that gates a package: a buffer form whose attention scale was changed is refused, the first prompt
    named with the step its logits pass the bound."""
    folder = tmp_path / "pkg"
    shutil.copytree(package, folder)
    model = ir.load(folder / "decode.onnx")
    for node in model.graph:
        if node.op_type == "GroupQueryAttention":
            node.attributes["scale"] = ir.AttrFloat32("scale", 0.5)
    ir.save(model, folder / "decode.onnx")
    said = json.loads((folder / "manifest.json").read_text())
    result = BufferFormResult("decode.onnx")
    prove_buffer_form(str(folder), "model.onnx", result, said, [3, 11, 6], 4, 256, 2)
    assert not result.passed and not result.proofs[0]
    assert str(result.proofs[0]).startswith("FAIL: the buffer form against the model's own inputs and outputs, "
                                            "prompt 0 (3 rows at once): a prompt of 3 tokens, 4 new: ")  # fmt: skip
    stats = result.proofs[0].stats  # the comparison's numbers, with the bound it was held to
    assert stats is not None and stats.atol > 0 and stats.max_abs > 0


def test_a_model_the_buffer_form_does_not_fit_keeps_its_own_io_and_says_why(tmp_path):
    """A cache read by a block attnx did not rewrite: no buffer form, the reason naming the cache, before anything is
    changed; with no block planned at all, nothing to write from. The optimized model's file untouched."""
    report = optimize_model(str(EXPORT), str(tmp_path / "model.onnx"), checkpoint=str(CHECKPOINT), serve=True)
    model, plans = report.served
    with pytest.raises(NotBufferable, match=r"past_key_values.1.key is read by a block attnx did not rewrite"):
        splice_served(model, plans[:1], 128)
    assert "seqlens_k" not in {v.name for v in model.graph.inputs}  # refused before the model was changed
    before = (tmp_path / "model.onnx").read_bytes()
    result = write_buffer_form(str(tmp_path), "model.onnx", (model, []))
    assert result.file is None and not (tmp_path / "decode.onnx").exists()
    assert result.reason.startswith("no block was planned")
    assert (tmp_path / "model.onnx").read_bytes() == before


def test_the_served_model_is_the_buffer_form_on_the_cpu_provider_only():
    manifest = {"models": [{"file": "model.onnx", "providers": ["cpu", "cuda"], "form": "growing"},
                           {"file": "decode.onnx", "providers": ["cpu", "cuda"], "form": "buffer"}]}  # fmt: skip
    assert served_model(manifest, "cpu")["file"] == "decode.onnx"
    assert served_model(manifest, "cuda")["file"] == "model.onnx"
    # a package written before the buffer form: its one model, whatever the provider
    assert served_model({"models": [{"file": "model.onnx", "providers": ["cpu"]}]}, "cpu")["file"] == "model.onnx"


def test_a_request_past_the_rope_table_is_refused_before_its_first_call(package):
    """The table holds the context's 128 positions: an engine told of no context, asked for 100 + 40 positions, says
    so before anything runs."""
    with _runner(package / "decode.onnx") as runner:
        engine = Engine(runner, max_batch=2)
        with pytest.raises(InputError, match=r"reaches position 139, past the model's rope table \(positions 0 to 127\)"):
            engine.run([Request(0, _prompts((100,))[0], 40)])
        assert engine.stats.prefills == 0


def test_a_weight_the_buffer_form_packs_is_the_concat_of_the_optimized_models_entries():
    """The buffer form's core packs q/k/v where the growing form's keeps them apart: its packed weight becomes the
    Concat of the optimized model's three (each byte compared), so the package holds each weight once; a weight that is
    no such columns stays its own, and one of the same name and bytes is the optimized model's."""
    from attnx.workflows._buffer_form import _share_tensors

    rng = np.random.default_rng(0)
    q, k, v, o = (rng.standard_normal((8, n)).astype(np.float32) for n in (8, 4, 4, 8))

    def model(weights: dict[str, np.ndarray]) -> ir.Model:
        x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 8]))
        graph = ir.Graph([x], [], nodes=[], name="g")
        for name, array in weights.items():
            value = ir.Value(name=name, const_value=ir.tensor(array), shape=ir.Shape(array.shape),
                             type=ir.TensorType(ir.DataType.FLOAT))  # fmt: skip
            graph.register_initializer(value)
            node = ir.node("MatMul", [x, value], outputs=[ir.Value(name=f"{name}/y")])
            graph.append(node)
            graph.outputs.append(node.outputs[0])
        return ir.Model(graph, ir_version=10)

    optimized = model({"q.T": q, "k.T": k, "v.T": v, "o.T": o})
    served = model({"qkv.T": np.concatenate([q, k, v], axis=1), "o.T": o, "other.T": q + 1})
    _share_tensors(served, optimized)
    inits = served.graph.initializers
    assert "qkv.T" not in inits and inits["o.T"].const_value is optimized.graph.initializers["o.T"].const_value
    joined = next(n for n in served.graph if n.op_type == "Concat")
    assert [i.name for i in joined.inputs] == ["q.T", "k.T", "v.T"] and joined.attributes.get_int("axis") == 1
    assert all(inits[n].const_value is optimized.graph.initializers[n].const_value for n in ("q.T", "k.T", "v.T"))
    assert np.array_equal(inits["other.T"].const_value.numpy(), q + 1)  # no columns of theirs: its own
