"""Multi-head latent attention (the config's `latent`, attnx.model.terms.Latent: DeepSeek-V2/V3's MLA): its config
keys in their normal form, its weights under transformers' names, the numpy reference and the torch module agreeing
at float64 full-sequence and step by step over the latent cache (left padding), and the cores that refuse it naming
the term. Against transformers itself: tests/workflows/test_import_mla.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from attnx.errors import ConfigError
from attnx.model import AttentionConfig, init_weights, reference_attention
from attnx.model.cores import CORES, why_not
from attnx.model.weights import weight_shapes
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.decode import decode_sequence, make_decode_inputs

torch = pytest.importorskip("torch")

# heads of 24 (8 rotated, 16 not) for q and k, 16 for v; latent ranks 16 (q) and 32 (kv)
MLA = AttentionConfig(d_model=64, n_heads=4, head_dim=24, v_head_dim=16, bias=False, causal=True,
                      key_padding_mask=True, rope={"theta": 10000.0, "dim": 8, "interleaved": True},
                      latent={"kv_lora_rank": 32, "q_lora_rank": 16, "eps": 1e-6})  # fmt: skip
# q_proj instead of the q latent, biases, half-split pairs, a yarn rope with its mscale ratio
PLAIN_Q = dataclasses.replace(MLA, bias=True, latent={"kv_lora_rank": 32, "q_lora_rank": None, "eps": 1e-6},
                              rope={"theta": 10000.0, "dim": 8, "interleaved": False, "scaling": {
                                  "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                                  "mscale": 1.0, "mscale_all_dim": 0.8}})  # fmt: skip


def test_the_latent_key_in_its_normal_form_and_its_weights_under_transformers_names():
    assert MLA.latent.to_dict() == {"kv_lora_rank": 32, "q_lora_rank": 16, "eps": 1e-6}
    assert AttentionConfig.from_json(MLA.to_json()) == MLA
    assert MLA.terms == ("latent", "rope", "causal", "key_padding_mask")
    assert weight_shapes(MLA) == {
        "q_a_proj.weight": (16, 64), "q_b_proj.weight": (96, 16), "kv_a_proj_with_mqa.weight": (40, 64),
        "kv_b_proj.weight": (4 * (16 + 16), 32), "out_proj.weight": (64, 64), "q_a_layernorm.weight": (16,),
        "kv_a_layernorm.weight": (32,)}  # fmt: skip
    shapes = weight_shapes(PLAIN_Q)  # attention_bias's projections: q_proj, kv_a_proj_with_mqa, out_proj
    assert {n for n in shapes if n.endswith(".bias")} == {"q_proj.bias", "kv_a_proj_with_mqa.bias", "out_proj.bias"}
    assert "q_a_layernorm.weight" not in shapes
    assert MLA.n_params == sum(math.prod(s) for s in weight_shapes(MLA).values())
    step = dataclasses.replace(MLA, kv_cache=True)  # the cache: the latent, one "head" of 8 + 32
    assert [(s.name, s.shape) for s in step.inputs() if "latent" in s.name] == [("past_latent", ("batch", 1, "past_seq", 40))]
    assert [(s.name, s.shape) for s in step.outputs()][1:] == [("present_latent", ("batch", 1, "total_seq", 40))]


@pytest.mark.parametrize("change, needle", [
    (dict(rope=None), "needs 'rope'"),
    (dict(n_kv_heads=2), "n_kv_heads"),
    (dict(rope={"theta": 10000.0, "dim": 24}), "below head_dim"),
    (dict(latent={"kv_lora_rank": 32}), "'latent' must be null or an object"),
    (dict(latent={"kv_lora_rank": 0, "q_lora_rank": None, "eps": 1e-6}), "latent.kv_lora_rank"),
    (dict(qk_norm={"eps": 1e-6}), "'latent' and 'qk_norm'"),
])  # fmt: skip
def test_a_latent_config_that_does_not_go_together_is_one_error_naming_the_key(change, needle):
    with pytest.raises(ConfigError, match=needle):
        dataclasses.replace(MLA, **change)


def _torch_outputs(config, weights, feeds, prefill):
    """The torch module at float64: the whole sequence, then a prefill and one token per step over its latent cache."""
    from attnx.model.module import build_module

    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    t["x"] = t["x"].double()
    with torch.no_grad():
        whole = build_module(config, weights).double()(**t).numpy()
        step_config = dataclasses.replace(config, kv_cache=True)
        module = build_module(step_config, weights).double()
        cache = torch.zeros(t["x"].shape[0], 1, 0, config.rope.dim + config.latent.kv_lora_rank, dtype=torch.float64)
        ys = []
        for start, stop in [(0, prefill)] + [(i, i + 1) for i in range(prefill, t["x"].shape[1])]:
            y, cache = module(t["x"][:, start:stop], key_padding_mask=t["key_padding_mask"][:, :stop],
                              position_ids=t["position_ids"][:, start:stop], past_latent=cache)  # fmt: skip
            ys.append(y.numpy())
    return whole, np.concatenate(ys, axis=1), cache.numpy()


@pytest.mark.parametrize("config", [MLA, PLAIN_Q], ids=["q-latent", "q-proj-bias-yarn"])
def test_the_reference_and_the_torch_module_agree_at_float64_full_and_step_by_step(config):
    weights = init_weights(config, seed=2)
    feeds = make_decode_inputs(config, 3, 9, seed=4)  # left padding: rows of 0, 2 and 4 padded tokens
    ref = reference_attention(config, weights, **feeds)
    whole, steps, cache = _torch_outputs(config, weights, feeds, prefill=5)
    np.testing.assert_allclose(whole, ref, atol=1e-12)
    np.testing.assert_allclose(steps, ref, atol=1e-12)
    # the reference step by step on its own latent cache (float64 throughout): the same outputs and cache
    step = dataclasses.replace(config, kv_cache=True)
    past, ys = np.zeros((3, 1, 0, 40)), []
    for start, stop in [(0, 5)] + [(i, i + 1) for i in range(5, 9)]:
        y, past = reference_attention(step, weights, feeds["x"][:, start:stop],
                                      key_padding_mask=feeds["key_padding_mask"][:, :stop],
                                      position_ids=feeds["position_ids"][:, start:stop], past_latent=past)  # fmt: skip
        ys.append(y)
    np.testing.assert_allclose(np.concatenate(ys, axis=1), ref, atol=1e-12)
    np.testing.assert_allclose(past, cache, atol=1e-12)
    assert past.shape == (3, 1, 9, 40)


def test_the_runners_decode_over_the_latent_cache():
    """Runner.prefill/step feed past_latent and read present_latent (config.cache_specs), reference and torch."""
    step = dataclasses.replace(MLA, kv_cache=True)
    weights = init_weights(MLA, seed=2)
    feeds = make_decode_inputs(MLA, 3, 7, seed=4)
    ref = reference_attention(MLA, weights, **feeds)
    for backend in ("reference", "torch"):
        with create_runner(backend, ModelSource(step, weights)) as runner:
            y, cache = decode_sequence(runner, feeds, 3, step)
        assert len(cache) == 1 and cache[0].shape == (3, 1, 7, 40)
        np.testing.assert_allclose(y, ref, atol=1e-5)


def test_a_core_that_cannot_compute_the_latent_names_it():
    step = dataclasses.replace(MLA, kv_cache=True)
    assert why_not("decomposed", MLA) == [] and why_not("decomposed", step) == []
    assert any("latent in int8" in r for r in why_not("decomposed", MLA, "int8"))  # its projections not quantized
    for name, core in CORES.items():
        if name != "decomposed":
            form = "full" if "full" in core.forms else "growing"
            reasons = why_not(name, MLA if form == "full" else step, form=form)
            assert any("latent" in r for r in reasons), (name, reasons)


# without a padding mask the step model takes the past length from its cache input, past_latent (not past_key)
@pytest.mark.parametrize("config", [MLA, PLAIN_Q, dataclasses.replace(MLA, key_padding_mask=False)],
                         ids=["q-latent", "q-proj-bias-yarn", "no-padding"])  # fmt: skip
def test_the_decomposed_graphs_agree_with_the_reference_full_and_over_the_latent_cache(config, tmp_path):
    """The decomposed core's emitted graphs (attnx.export._latent): the full sequence (k and v expanded), and the step
    model in the absorbed form (kv_b_proj's halves folded into q and the heads' outputs, attention over the latents as
    one key/value head) whose cache is past_latent/present_latent, a prefill then single steps on ONNX Runtime,
    left-padded, each against the float64 formula."""
    import onnx

    from attnx.export._emit import build_model
    from attnx.model.tolerance import problem_size, tolerance_for
    from attnx.runtimes.compare import compare_arrays

    weights = init_weights(config, seed=2)
    feeds = make_decode_inputs(config, 3, 9, seed=4)
    ref = reference_attention(config, weights, **feeds)
    step = dataclasses.replace(config, kv_cache=True)
    size, tol = problem_size(config, weights, feeds), tolerance_for("fp32")
    for cfg, name in ((config, "full"), (step, "step")):
        path = str(tmp_path / f"{name}.onnx")
        model = build_model(cfg, weights, "decomposed")
        folded = {"kv_b_proj.k_half", "kv_b_proj.v_half.T"} & {t.name for t in model.graph.initializer}
        assert bool(folded) == (name == "step")  # absorbed in the step model alone
        onnx.save(model, path)
        with create_runner("ort-cpu", ModelSource(cfg, None, path)) as runner:
            if name == "full":
                y = runner.run(feeds)["y"]
            else:
                assert [s.name for s in runner.inputs][1] == "past_latent"
                y, (latent,) = decode_sequence(runner, feeds, 5, step)
                assert latent.shape == (3, 1, 9, 40)
        assert compare_arrays(f"decomposed {name}", y, ref, tol, size)


def test_what_a_cached_token_costs_is_read_from_the_cache_layout():
    """cache_values: the memory a step reads a cached token for (bench's bound, the memory estimate): 1 x (rope +
    kv_lora_rank) for MLA, n_kv_heads x (head_dim + v_head_dim) for keys and values."""
    from attnx.bench._decode import step_bytes
    from attnx.model.resources import cache_bytes

    step = dataclasses.replace(MLA, kv_cache=True)
    assert step.cache_values() == 8 + 32
    plain = dataclasses.replace(step, latent=None)
    assert plain.cache_values() == 4 * (24 + 16)
    assert cache_bytes(step, 2, 10) == 2 * 10 * 40 * 4
    assert step_bytes(step, 99) - step_bytes(step, 49) == 50 * 40 * 4  # 50 more cached tokens read


@pytest.mark.parametrize(("calls", "expands"), [
    ((16, 0), True),  # a prompt: expanded, always
    ((1, 0), True),  # a one-token prompt: either (no key to spare), expanded
    ((1, 100), False),  # a step: absorbed
    ((4, 4096), False),  # a short chunk after a long cache: expanding 4100 keys costs more than 4 rows absorbed
    ((512, 2048), True),  # DeepSeek-V3's own sizes: S (P + S) 832 > P 131072
])  # fmt: skip
def test_the_step_model_expands_a_prompt_and_absorbs_a_step(calls, expands):
    """The latent step model's If (attnx.export._latent.prompt_expands) at DeepSeek-V3's head sizes (rope 64, kv rank
    512, nope 128, v 128; 2 heads): the expanded heads where they cost fewer multiply-adds, the absorbed ones
    otherwise; the cache written once, outside it."""
    import onnx
    import onnxruntime as ort

    config = AttentionConfig(d_model=64, n_heads=2, head_dim=192, v_head_dim=128, causal=True, kv_cache=True,
                             rope={"theta": 10000.0, "dim": 64, "interleaved": True},
                             latent={"kv_lora_rank": 512, "q_lora_rank": None, "eps": 1e-6})  # fmt: skip
    from attnx.export._emit import build_model

    model = build_model(config, init_weights(config, seed=0), "decomposed")
    (switch,) = [n for n in model.graph.node if n.op_type == "If"]
    assert sorted(a.g.name for a in switch.attribute) == ["absorbed", "expanded"]
    assert {n.op_type for n in model.graph.node} >= {"Concat"} and "present_latent" in {o.name for o in
                                                                                         model.graph.output}
    model.graph.output.append(onnx.helper.make_tensor_value_info(switch.input[0], onnx.TensorProto.BOOL, []))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    seq, past = calls
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, seq, 64), dtype=np.float32),
             "past_latent": rng.standard_normal((1, 1, past, 576), dtype=np.float32),
             "position_ids": np.arange(past, past + seq, dtype=np.int64)[None]}  # fmt: skip
    assert bool(session.run([switch.input[0]], feeds)[0]) is expands


def test_a_chunk_after_the_cache_through_either_branch_agrees_with_the_reference():
    """A prefill, then a chunk that the If expands (8 tokens after 1) and one it absorbs (2 after 9), then steps,
    against the float64 formula: both branches compute it."""
    import onnxruntime as ort

    from attnx.export._emit import build_model
    from attnx.model.tolerance import problem_size, tolerance_for
    from attnx.runtimes.compare import compare_arrays

    step = dataclasses.replace(MLA, kv_cache=True, key_padding_mask=False)
    weights = init_weights(step, seed=3)
    x = np.random.default_rng(5).standard_normal((2, 14, 64)).astype(np.float32)
    full, positions = dataclasses.replace(step, kv_cache=False), np.tile(np.arange(14), (2, 1))
    ref = reference_attention(full, weights, x, position_ids=positions)
    session = ort.InferenceSession(build_model(step, weights, "decomposed").SerializeToString(),
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    past, ys = np.zeros((2, 1, 0, 40), np.float32), []
    for start, end in ((0, 1), (1, 9), (9, 11), (11, 12), (12, 14)):
        y, past = session.run(["y", "present_latent"], {"x": x[:, start:end], "past_latent": past,
                                                         "position_ids": np.tile(np.arange(start, end), (2, 1))})
        ys.append(y)
    size = problem_size(full, weights, {"x": x, "position_ids": positions})
    assert compare_arrays("chunks", np.concatenate(ys, axis=1), ref, tolerance_for("fp32"), size)
