"""The step model (kv_cache) of the modern-LLM layers, decomposed: prefill then single-token steps with
Hugging Face's position_ids of a left-padded batch, on reference, torch, ort-cpu and openvino, against
the reference's full forward (y and the cache of rotated keys), at position 8192 too; steps fed
positions off by one fail; position_ids are required exactly where the config has rope."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnx.errors import InputError
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes.decode import make_decode_inputs, run_decode_parity
from attnx.workflows import export_model
from tests.conftest import CONFIGS, LLM_CONFIGS, weights_for

TESTED_BACKENDS = ["reference", "torch", "ort-cpu", "openvino"]


@pytest.fixture(scope="module")
def step_model(tmp_path_factory):
    """step_model(name) -> (config, weights, path): the checked export (its own step validation ran)."""
    root, made = tmp_path_factory.mktemp("llm-steps"), {}

    def get(name: str):
        if name not in made:
            config = dataclasses.replace(LLM_CONFIGS[name], kv_cache=True)
            path = str(root / f"{name}.onnx")
            export_model(config, path, weights_for(name), attention="decomposed")
            made[name] = (config, weights_for(name), path)
        return made[name]

    return get


@pytest.mark.parametrize(("name", "offset"), [("llm", 0), ("llama", 8192)])
def test_llm_decode_parity_on_every_backend(step_model, name, offset):
    config, weights, path = step_model(name)
    report = run_decode_parity(ModelSource(config, weights, path), TESTED_BACKENDS, prefills=(0, 5), steps=6, batch=3,
                               position_offset=offset)  # fmt: skip
    failed = [c for c in report.cases if c.status == "fail"]
    assert report.passed and not failed, failed[0].reason if failed else report.summary()
    ran = {c.backend for c in report.cases if c.status == "pass"}
    assert {"reference", "torch", "ort-cpu"} <= ran


def test_steps_fed_wrong_positions_fail(step_model):
    """A planted fault: every single-token step is fed positions one too far (the prefill's are right)."""
    config, weights, path = step_model("llama")

    def factory(name, source):
        runner = create_runner(name, source)
        if name == "ort-cpu":
            right = runner.step

            def shifted(x, state, key_padding_mask=None, position_ids=None):
                moved = position_ids + 1 if position_ids is not None and state.length else position_ids
                return right(x, state, key_padding_mask, moved)

            runner.step = shifted
        return runner

    report = run_decode_parity(ModelSource(config, weights, path), ["ort-cpu"], prefills=(3,), steps=4, batch=2,
                               runner_factory=factory)  # fmt: skip
    assert [c.status for c in report.cases] == ["fail"]


def test_position_ids_are_required_exactly_with_rope(step_model):
    config, weights, path = step_model("llama")
    feeds = make_decode_inputs(config, 2, 4)
    assert feeds["position_ids"].tolist() == [[0, 1, 2, 3], [1, 1, 0, 1]]  # row 1 left-padded by two
    with create_runner("ort-cpu", ModelSource(config, weights, path)) as runner:
        with pytest.raises(InputError, match="each step takes position_ids"):
            runner.prefill(feeds["x"][:, :2])
    plain = dataclasses.replace(CONFIGS["causal"], kv_cache=True)
    with create_runner("reference", ModelSource(plain, weights_for("causal"))) as ref:
        with pytest.raises(InputError, match="takes no position_ids"):
            ref.prefill(np.zeros((1, 2, 32), np.float32), position_ids=np.zeros((1, 2), np.int64))
