"""A whole model's package (attnx build --model) and what serves it: its golden generations verified here and after the
folder moves, a tampered file named; attnx generate's tokens equal to transformers' greedy generate on the fixtures
(windows, softcap, q/k norms, longrope), whether a prompt runs alone or beside prompts of other lengths; sampling
seeded per prompt; bad prompts refused by line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from attnx.cli import main
from attnx.runtimes.package import load, verify_package
from attnx.workflows import build_model_package

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DYNAMO = FIXTURES / "exported" / "torch-dynamo"
UNSEEN = FIXTURES / "unseen"
# (export, checkpoint): the families and their terms, each a package built once for this file
MODELS = {
    "llama": (DYNAMO / "llama" / "sdpa-opset20", FIXTURES / "genai" / "llama" / "checkpoint"),
    "gemma2": (DYNAMO / "gemma2" / "eager-opset20", FIXTURES / "genai" / "gemma2" / "checkpoint"),  # window 8, softcap
    "qwen3": (DYNAMO / "qwen3" / "sdpa-opset23", FIXTURES / "genai" / "qwen3" / "checkpoint"),  # q/k norms
    "mistral": (UNSEEN / "exported" / "torch-dynamo" / "mistral" / "sdpa-opset20",
                UNSEEN / "genai" / "mistral" / "checkpoint"),  # window 5, head_dim 32
    "phi3": (UNSEEN / "exported" / "torch-dynamo" / "phi3" / "eager-opset20",
             UNSEEN / "genai" / "phi3" / "checkpoint"),  # longrope, original length 64
    "genai-llama": (FIXTURES / "genai" / "llama" / "fp32", FIXTURES / "genai" / "llama" / "checkpoint"),  # GQA, lengths
    "llama4": (DYNAMO / "llama4" / "sdpa-opset20", DYNAMO / "llama4" / "checkpoint"),  # the temperature, by slot
    "gpt2": (DYNAMO / "gpt2" / "sdpa-opset20", DYNAMO / "gpt2" / "checkpoint"),  # learned positions, no rope
    "genai-fp16": (FIXTURES / "genai" / "llama" / "fp16", FIXTURES / "genai" / "llama" / "checkpoint"),  # fp16 logits
}  # fmt: skip
NEW = 32


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            export, checkpoint = MODELS[name]
            out = tmp_path_factory.mktemp(name) / "pkg"
            build_model_package(str(export / "model.onnx"), out, checkpoint=str(checkpoint))
            built[name] = out
        return built[name]

    return get


def _prompts(vocab: int, lengths=(5, 12, 3, 21, 9)) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(1, vocab, n)] for n in lengths]


def _transformers_greedy(checkpoint: Path, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy generate of one prompt (no padding), its new tokens; eos never ends it early."""
    import torch

    from tests.fixtures.fixturelib import load_eager

    model = load_eager(checkpoint)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)  # fmt: skip
    return [int(t) for t in out[0, len(prompt):]]


@pytest.mark.parametrize("name", ["llama", "gemma2", "qwen3", "mistral", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_generate_gives_transformers_greedy_tokens_alone_and_mixed(name, packages):
    """32 new tokens of prompts of 3 to 21 tokens (past gemma2's window of 8 and mistral's of 5): each prompt alone
    (one row at a time), three rows at once (rows of other lengths, joining between steps), all of them at once (the
    default), and transformers' greedy generate of each alone, the same tokens."""
    with load(packages(name)) as model:
        prompts = _prompts(model.vocab)
        mixed = model.generate(prompts, max_new_tokens=NEW, max_batch=3)
        assert model.stats.largest_batch == 3
        alone = model.generate(prompts, max_new_tokens=NEW, max_batch=1)
        every = model.generate(prompts, max_new_tokens=NEW)  # by default: every prompt at once, never the recorded 3
        assert model.stats.largest_batch == len(prompts) > model.manifest["generations"]["max_batch"]
    truth = [_transformers_greedy(MODELS[name][1], p, NEW) for p in prompts]
    assert alone == truth
    assert mixed == truth
    assert every == truth


def test_the_default_batch_is_every_request_within_half_the_memory_available(packages, monkeypatch):
    """Without max_batch the engine decodes every request at once, unless half the memory available holds fewer
    rows' caches (each as long as the longest request): then as many as it holds, the tokens the same."""
    from attnx.runtimes import generate
    from attnx.runtimes.model_package import engine_for

    with load(packages("llama")) as model:
        prompts = _prompts(model.vocab)
        engine = engine_for(model.runner, model.manifest)
        requests = [generate.Request(i, p, NEW) for i, p in enumerate(prompts)]
        assert engine.batch_rows(requests) == len(prompts)
        longest = max(len(p) for p in prompts) + NEW
        row = longest * 4 * sum(s.token_values for s in engine.io.caches)  # float32 caches
        monkeypatch.setattr(generate, "available_memory_bytes", lambda: 2 * 2 * row + 1)  # half of it: 2 rows
        assert engine.batch_rows(requests) == 2
        tokens = model.generate(prompts, max_new_tokens=NEW)
        assert model.stats.largest_batch == 2
        assert tokens == model.generate(prompts, max_new_tokens=NEW, max_batch=1)


@pytest.mark.slow  # the slow tier: more families (README, the fast tier)
def test_the_genai_builders_model_is_served_in_its_buffer_form_with_transformers_tokens(packages):
    """ONNX Runtime GenAI's builder model: its GroupQueryAttention reads each row's length from attention_mask (right
    padding), rotates q and k itself (do_rotary) and its cache names its head size kv_cache_dim. The package records
    the cache's heads and head size as the blocks read them; its buffer form (each row its own length, which is the
    op's positions) serves rows of other lengths together: transformers' greedy tokens."""
    pkg = packages("genai-llama")
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["padding"] == "right" and manifest["cache_dims"]["past_key_values.0.key"] == [2, 16]
    assert manifest["decode"]["file"] == "decode.onnx"
    with load(pkg) as model:
        prompts = _prompts(model.vocab, (5, 12, 3))
        tokens = model.generate(prompts, max_new_tokens=NEW, max_batch=3)
        assert model.stats.largest_batch == 3 and model.stats.form == "buffer"
    assert tokens == [_transformers_greedy(MODELS["genai-llama"][1], p, NEW) for p in prompts]


def test_a_builder_int4_model_whose_kernels_multiply_in_int8_is_served_in_its_buffer_form(tmp_path):
    """The builder's int4 model (MatMulNBits at accuracy_level 4: activations rounded to int8): its buffer form parts
    from its own inputs and outputs by one int8 rounding of z (0.028 in the logits), past the whole-model bound, so
    the form is proven on both forms' float32-compute twins (accuracy_level 1, every other byte the same), which
    leave nothing behind; the form served is the model's (level 4), rows together, each row's tokens its own alone,
    and the package verifies."""
    pkg = tmp_path / "pkg"
    build_model_package(str(FIXTURES / "genai" / "llama" / "int4" / "model.onnx"), pkg,
                        checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"))  # fmt: skip
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["decode"]["file"] == "decode.onnx" and sorted(p.name for p in pkg.iterdir()) == sorted(
        [*manifest["files"], "manifest.json", "manifest.sha256"])  # fmt: skip
    assert all(line.startswith("pass: the buffer form against the model's own inputs and outputs, each with its "
                               "MatMulNBits computing in float32 (accuracy_level 1; served at 4)")
               for line in manifest["decode"]["proofs"])  # fmt: skip
    levels = {a.i for n in onnx.load(str(pkg / "decode.onnx"), load_external_data=False).graph.node
              if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}  # fmt: skip
    assert levels == {4}
    assert verify_package(str(pkg)).passed
    with load(pkg) as model:
        prompts = _prompts(model.vocab, (5, 12, 3))
        together = model.generate(prompts, max_new_tokens=NEW)
        assert model.stats.largest_batch == 3 and model.stats.form == "buffer"
        assert together == model.generate(prompts, max_new_tokens=NEW, max_batch=1)


@pytest.mark.slow  # the slow tier: more families (README, the fast tier)
def test_the_genai_builders_fp16_model_is_packaged_and_served_in_fp16(packages):
    """The builder's fp16 CPU model fails at its first decoding step as built; optimized (its cores rewritten alone in
    fp16) it is packaged with its buffer form, whose logits are float16 like the model's, and served: each prompt's
    tokens the same beside others as alone (fp16 near-ties may part from transformers' float32 ones)."""
    pkg = packages("genai-fp16")
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["tolerance"]["dtype"] == "fp16" and manifest["decode"]["file"] == "decode.onnx"
    with load(pkg) as model:
        prompts = _prompts(model.vocab, (5, 12, 3))
        mixed = model.generate(prompts, max_new_tokens=NEW, max_batch=3)
        assert model.stats.largest_batch == 3
        alone = model.generate(prompts, max_new_tokens=NEW, max_batch=1)
    assert mixed == alone and all(len(t) == NEW for t in mixed)


@pytest.mark.slow  # the slow tier: more families (README, the fast tier)
def test_a_term_computed_from_a_tokens_slot_serves_rows_alone_with_transformers_tokens(packages):
    """Llama 4's NoPE temperature is computed from a token's slot, padding included (transformers' rule, the export's
    too): a left-padded row gets other values than it has alone, so the package serves a row at a time (its manifest
    says why) and every prompt gets transformers' greedy tokens whatever else is asked with it."""
    pkg = packages("llama4")
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["one_row"].startswith("attn_temperature: computed from a token's slot")
    with load(pkg) as model:
        prompts = _prompts(model.vocab, (5, 12, 3, 21))
        tokens = model.generate(prompts, max_new_tokens=NEW, max_batch=3)
        assert model.stats.largest_batch == 1
    assert tokens == [_transformers_greedy(MODELS["llama4"][1], p, NEW) for p in prompts]


def test_longrope_across_its_original_length_follows_the_cache_not_generate(packages):
    """Phi-3's longrope (original length 64): below it, transformers' generate and attnx's agree; a prompt whose
    tokens cross it agrees with transformers' forward step by step through its cache (what the exported model
    computes), while transformers' generate drops its cache and recomputes with the long factors there."""
    import torch

    from tests.fixtures.fixturelib import load_eager

    checkpoint = MODELS["phi3"][1]
    with load(packages("phi3")) as model:
        short, crossing = _prompts(model.vocab, (9, 50))
        ours = model.generate([short, crossing], max_new_tokens=24, max_batch=2)
    assert ours[0] == _transformers_greedy(checkpoint, short, 24)  # 9 + 24 < 64
    hf = load_eager(checkpoint)
    tokens, past = list(crossing), None
    with torch.no_grad():  # transformers' forward with its cache, one token a step
        for _ in range(24):
            ids = torch.tensor([tokens if past is None else tokens[-1:]])
            out = hf(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    assert ours[1] == tokens[len(crossing):]
    assert ours[1] != _transformers_greedy(checkpoint, crossing, 24)  # generate's recompute, from position 65 on


def test_the_package_verifies_here_and_after_it_moves_and_names_what_was_tampered(packages, tmp_path, capsys):
    pkg = packages("llama")
    manifest = json.loads((pkg / "manifest.json").read_text())
    assert manifest["kind"] == "model" and manifest["format_version"] == 2
    # the model's own I/O and its buffer form, one weights file between them; the goldens recorded from the form served
    assert set(manifest["files"]) == {"model.onnx", "decode.onnx", "model.onnx.data", "generations.npz", "optimize.json",
                                      "tokenizer.json", "tokenizer_config.json", "generation_config.json"}  # its text
    assert [(m["file"], m["form"], m["external_data"]) for m in manifest["models"]] == [
        ("model.onnx", "growing", ["model.onnx.data"]), ("decode.onnx", "buffer", ["model.onnx.data"])]
    assert manifest["generations"]["model"] == manifest["decode"]["file"] == "decode.onnx"
    assert manifest["decode"]["proofs"] and all(p.startswith("pass: ") for p in manifest["decode"]["proofs"])
    assert manifest["generations"]["requests"] == 4 and manifest["verified_on"] == ["cpu"]
    moved = tmp_path / "elsewhere"
    shutil.copytree(pkg, moved)
    assert main(["verify", str(moved)]) == 0
    assert "verify PASSED (cpu)" in capsys.readouterr().out
    data = bytearray((moved / "generations.npz").read_bytes())
    data[-100] ^= 1  # one bit of the golden generations
    (moved / "generations.npz").write_bytes(bytes(data))
    assert main(["verify", str(moved)]) == 1
    out = capsys.readouterr().out
    assert "generations.npz: sha256" in out and "(altered)" in out


def test_a_golden_token_that_the_model_does_not_give_is_named_by_request_and_step(packages, tmp_path):
    """A package whose golden generations say another token (its hashes made to match, as a careless rebuild would):
    verify fails naming the request, the step and both tokens."""
    from attnx.runtimes.package import file_sha256

    pkg = tmp_path / "pkg"
    shutil.copytree(packages("llama"), pkg)
    with np.load(pkg / "generations.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    golden = int(arrays["tokens_1"][3])
    arrays["tokens_1"][3] = (golden + 1) % 256
    np.savez(pkg / "generations.npz", **arrays)
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["files"]["generations.npz"] = {"size": (pkg / "generations.npz").stat().st_size,
                                            "sha256": file_sha256(str(pkg / "generations.npz"))}  # fmt: skip
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    (pkg / "manifest.sha256").write_text(f"{file_sha256(str(pkg / 'manifest.json'))}  manifest.json\n")
    report = verify_package(pkg)
    failed = report.failures()
    assert [c.name for c in failed] == ["generation 1"]
    assert failed[0].detail.endswith(f"step 3: greedy token {golden}, the golden one {(golden + 1) % 256}")


def test_generate_through_the_cli_in_order_with_eos_and_seeded_sampling(packages, tmp_path, capsys):
    pkg = packages("llama")
    prompts = _prompts(256, (4, 15, 2, 9, 30, 6, 11))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "o.jsonl"
    assert main(["generate", str(pkg), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out),
                 "--max-new-tokens", "12", "--max-batch", "3"]) == 0  # fmt: skip
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    with load(pkg) as model:
        assert lines == model.generate(prompts, max_new_tokens=12, max_batch=1)
        eos = lines[0][4]  # a token the first prompt gives at step 4: it ends there, itself included
        ended = model.generate(prompts[:1], max_new_tokens=12, eos=[eos])[0]
        assert ended == lines[0][: lines[0].index(eos) + 1]
        sampled = [model.generate(prompts, max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=5,
                                  max_batch=b) for b in (1, 4)]  # fmt: skip
        assert sampled[0] == sampled[1] and sampled[0] != lines  # its own draws, whatever shares its batch
        other = model.generate(prompts, max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=6)
        assert other != sampled[0]
    assert f"wrote {out}: 7 lines" in capsys.readouterr().out


@pytest.mark.parametrize(("line", "says"), [
    ("[1, 2, 3.5]", "--prompts line 2: not a non-empty JSON list of token ids"),
    ("[]", "--prompts line 2: not a non-empty JSON list"),
    ("[1, 999]", "--prompts line 2: token id 999 is outside the vocabulary (0 to 255)"),
    ("{", "--prompts line 2: not JSON"),
    (json.dumps(list(range(1, 129))), "--prompts line 2: 128 tokens, the model's context is 128"),
])  # fmt: skip
def test_a_bad_prompt_is_one_error_naming_its_line(packages, tmp_path, capsys, line, says):
    (tmp_path / "p.jsonl").write_text("[5, 6]\n" + line + "\n")
    out = tmp_path / "o.jsonl"
    assert main(["generate", str(packages("llama")), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(out)]) == 2
    assert says in capsys.readouterr().err and not out.exists()


def test_generate_refuses_a_layers_package(tmp_path, capsys):
    assert main(["build", "--preset", "tiny", "--out", str(tmp_path / "layer"), "--provider", "cpu"]) == 0
    (tmp_path / "p.jsonl").write_text("[1, 2]\n")
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "layer"), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "o.jsonl")]) == 2  # fmt: skip
    assert "holds one attention layer" in capsys.readouterr().err


def test_run_refuses_a_whole_models_package_and_inspect_describes_it(packages, tmp_path, capsys):
    np.save(tmp_path / "x.npy", np.ones((1, 3, 64), np.float32))
    pkg = packages("llama")
    assert main(["run", str(pkg), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy")]) == 2
    assert "a whole model's package (attnx build --model)" in capsys.readouterr().err
    assert main(["inspect", str(pkg)]) == 0
    out = capsys.readouterr().out
    assert "kind: model" in out and '"lengths": [3, 11, 6, 17]' in out


def test_a_whole_models_caches_are_read_as_their_layouts_a_latent_one_included():
    """ModelIO.of reads each cache input as a layout (CacheSpec: its past and present, sizes, the growing dim): a
    latent cache [batch, 1, past, 576] (MLA's, one "head") costs a row 576 values a position, per-head keys and
    values heads x (head_dim + v_head_dim); a size the model names is taken from what its blocks said."""
    from types import SimpleNamespace

    from attnx.model.config import TensorSpec
    from attnx.runtimes.generate import Engine

    def runner(caches):
        inputs = [TensorSpec("input_ids", "int64", ("batch", "seq")),
                  *(TensorSpec(f"past_key_values.0.{n}", "fp32", shape) for n, shape in caches)]  # fmt: skip
        outputs = [TensorSpec("logits", "fp32", ("batch", "seq", 32)),
                   *(TensorSpec(f"present.0.{n}", "fp32", shape) for n, shape in caches)]  # fmt: skip
        return SimpleNamespace(inputs=inputs, outputs=outputs, name="fake")

    latent = Engine(runner([("latent", ("batch", 1, "past", 576))]))
    (spec,) = latent.io.caches
    assert (spec.past, spec.present, spec.sized(3, 5)) == ("past_key_values.0.latent", "present.0.latent", (3, 1, 5, 576))
    assert latent.row_bytes(10) == 10 * 4 * 576
    kv = Engine(runner([("key", ("batch", 2, "past", "kv_cache_dim")), ("value", ("batch", 2, "past", 8))]),
                cache_dims={"past_key_values.0.key": [2, 16]})  # fmt: skip
    assert kv.row_bytes(10) == 10 * 4 * 2 * (16 + 8)
