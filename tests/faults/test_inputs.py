"""Every subcommand x every file argument x every kind of bad file, and every numeric argument x
{negative, zero, huge, not an integer}: generated, each run held to the promise of conftest.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnx.model import describe
from attnx.runtimes.package import verify_package
from tests.faults.conftest import (
    DRAWN_KINDS,
    FAULT_KINDS,
    FAULT_SETTINGS,
    NUMBER_SETTINGS,
    SENTINEL,
    assert_contract,
    make_fault,
    run_cli,
    snapshot,
)

# the slow tier: bad input to every command, each as a process
pytestmark = pytest.mark.slow

# A bench run small enough to finish in seconds when its arguments happen to be valid.
QUICK_BENCH = ["--backends", "ort-cpu", "--attention", "decomposed", "--seq", "4", "--repeat", "1", "--warmup", "0",
               "--threads", "1"]  # fmt: skip


FOLDER_OUTPUTS = ("pkg", "imp")  # outputs that are folders (absent before the run)


def complete(path: str) -> None:
    """A written output is whole and what its kind says."""
    if path.endswith("imp"):
        from attnx.model import load_config, load_weights

        load_weights(os.path.join(path, "weights.safetensors"), load_config(os.path.join(path, "config.json")))
    elif path.endswith(".onnx"):
        assert describe(path).config is not None
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            json.load(f)
    elif path.endswith(".npy"):
        assert np.load(path, allow_pickle=False).size
    elif path.endswith(".jsonl"):  # generate's lines: one JSON list of token ids a prompt
        with open(path, encoding="utf-8") as f:
            assert all(isinstance(json.loads(line), list) for line in f)
    else:
        assert verify_package(path).passed


# (case, the kind of file the argument takes, argv from (the argument's path, the assets, the
# work folder), the outputs the command writes). Every file argument of every subcommand.
FILE_CASES = {
    "export --config": ("config", lambda p, a, w: ["export", "--config", p, "--out", w / "m.onnx"], ["m.onnx"]),
    "export --weights": ("weights", lambda p, a, w: ["export", "--config", a["config"], "--weights", p, "--out",
                                                      w / "m.onnx"], ["m.onnx"]),
    "build --config": ("config", lambda p, a, w: ["build", "--config", p, "--provider", "cpu", "--out", w / "pkg"],
                       ["pkg"]),
    "build --weights": ("weights", lambda p, a, w: ["build", "--config", a["config"], "--weights", p, "--provider",
                                                     "cpu", "--out", w / "pkg"], ["pkg"]),
    "parity --config": ("config", lambda p, a, w: ["parity", "--config", p, "--backends", "reference,torch",
                                                    "--seq", "2", "--batch", "2", "--json", w / "p.json"], ["p.json"]),
    "parity --weights": ("weights", lambda p, a, w: ["parity", "--config", a["config"], "--weights", p, "--backends",
                                                      "torch", "--seq", "2", "--json", w / "p.json"], ["p.json"]),
    "parity --model": ("model", lambda p, a, w: ["parity", "--config", a["config"], "--model", p, "--backends",
                                                  "ort-cpu", "--seq", "2", "--json", w / "p.json"], ["p.json"]),
    "bench --config": ("config", lambda p, a, w: ["bench", "--config", p, *QUICK_BENCH, "--json", w / "b.json"],
                       ["b.json"]),
    "bench --weights": ("weights", lambda p, a, w: ["bench", "--config", a["config"], "--weights", p, *QUICK_BENCH,
                                                     "--json", w / "b.json"], ["b.json"]),
    "bench --model": ("model", lambda p, a, w: ["bench", "--model", p, *QUICK_BENCH, "--json", w / "b.json"],
                      ["b.json"]),
    "optimize IN": ("model", lambda p, a, w: ["optimize", p, "--out", w / "o.onnx"], ["o.onnx"]),
    "verify DIR": ("package", lambda p, a, w: ["verify", p, "--json", w / "v.json"], ["v.json"]),
    "run DIR|MODEL": ("model", lambda p, a, w: ["run", p, "--input", a["npy"], "--key-padding-mask", a["mask"],
                                                 "--output", w / "y.npy"], ["y.npy"]),
    "run --input": ("npy", lambda p, a, w: ["run", a["model"], "--input", p, "--key-padding-mask", a["mask"],
                                             "--output", w / "y.npy"], ["y.npy"]),
    "run --key-padding-mask": ("mask", lambda p, a, w: ["run", a["model"], "--input", a["npy"], "--key-padding-mask",
                                                         p, "--output", w / "y.npy"], ["y.npy"]),
    "run --past-key": ("past", lambda p, a, w: ["run", a["step"], "--input", a["x1"], "--past-key", p, "--past-value",
                                                 a["past_value"], "--output", w / "y.npy"], ["y.npy"]),
    "inspect DIR|MODEL": ("model", lambda p, a, w: ["inspect", p, "--json"], []),
    "build --model": ("foreign", lambda p, a, w: ["build", "--model", p, "--core", "gqa", "--out", w / "pkg"], ["pkg"]),
    "generate PKG": ("model_pkg", lambda p, a, w: ["generate", p, "--prompts", a["prompts"], "--out", w / "o.jsonl"],
                     ["o.jsonl"]),
    "generate --prompts": ("prompts", lambda p, a, w: ["generate", a["model_pkg"], "--prompts", p, "--out",
                                                        w / "o.jsonl"], ["o.jsonl"]),
    "import CHECKPOINT_DIR": ("checkpoint", lambda p, a, w: ["import", p, "--out", w / "imp"], ["imp"]),
}  # fmt: skip
# A valid file of another kind, for each kind (what a user passes by mistake).
OTHER_KIND = {"config": "weights", "weights": "config", "model": "npy", "package": "model", "npy": "model",
              "mask": "config", "checkpoint": "package", "past": "npy", "foreign": "model", "model_pkg": "package",
              "prompts": "config"}  # fmt: skip


@pytest.mark.parametrize("kind", [k for k in FAULT_KINDS if k not in DRAWN_KINDS])
@pytest.mark.parametrize("case", list(FILE_CASES))
def test_a_bad_file_argument_is_refused_in_one_line(assets, tmp_path_factory, case, kind):
    """The kinds that draw nothing: one run each."""
    _bad_file(assets, tmp_path_factory, case, kind, b"", 0.0)


@pytest.mark.parametrize("kind", DRAWN_KINDS)
@pytest.mark.parametrize("case", list(FILE_CASES))
@FAULT_SETTINGS
@given(data=st.binary(min_size=1, max_size=4096), fraction=st.floats(0.0, 1.0))
def test_random_or_truncated_file_is_refused_in_one_line(assets, tmp_path_factory, case, kind, data, fraction):
    _bad_file(assets, tmp_path_factory, case, kind, data, fraction)


def _bad_file(assets, tmp_path_factory, case: str, kind: str, data: bytes, fraction: float) -> None:
    file_kind, argv, outputs = FILE_CASES[case]
    work = tmp_path_factory.mktemp("fault")
    path = str(work / ("arg" + os.path.splitext(str(assets[file_kind]))[1]))
    make_fault(kind, path, assets[file_kind], data, fraction, assets[OTHER_KIND[file_kind]])
    before = {}
    for name in outputs:  # an earlier output at each file output's path: it must survive a failure
        out = str(work / name)
        if name not in FOLDER_OUTPUTS:
            with open(out, "wb") as f:
                f.write(SENTINEL)
        before[out] = snapshot(out)
    outcome = run_cli(argv(path, assets, work))
    assert_contract(outcome, before, complete)
    if kind in ("missing", "empty", "folder", "symlink-out", "wrong-kind"):
        assert outcome.rc in (1, 2), (case, kind, outcome.err[-1000:])


# Numeric arguments ------------------------------------------------------------------------------
# The classes of a bad (or edge) number, each one path through parsing and checking, so that one
# drawn value stands for its class: {negative, zero, huge, not an integer}, each split by form.
VALUE_CLASSES = ("negative", "negative-float", "zero", "huge", "huge-float", "fraction", "not-finite", "text")


def _values(cls: str):
    return {
        "negative": st.integers(max_value=-1),
        "negative-float": st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False),
        "zero": st.sampled_from(["0", "0.0", "-0"]),
        "huge": st.integers(min_value=10**12, max_value=10**40),
        "huge-float": st.sampled_from(["1e300", "inf", "1e12"]),
        "fraction": st.floats(-1e6, 1e6).filter(lambda v: v != int(v)),
        "not-finite": st.sampled_from(["nan", "-inf", "NaN"]),
        "text": st.text(min_size=1, max_size=8).filter(lambda t: not _is_number(t)),
    }[cls]  # fmt: skip


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# (case, argv from (the value, assets, work folder), outputs)
NUMERIC_CASES = {
    # a lowering written from the registry: a huge seed's weights are new, and a decomposed export would trace them
    "export --seed": (lambda v, a, w: ["export", "--config", a["config"], "--seed", v, "--attention", "ort-fused",
                                       "--no-validate", "--out", w / "m.onnx"], ["m.onnx"]),
    "export --opset": (lambda v, a, w: ["export", "--config", a["config"], "--opset", v, "--out", w / "m.onnx"],
                       ["m.onnx"]),
    "export --max-mem-gb": (lambda v, a, w: ["export", "--config", a["config"], "--max-mem-gb", v, "--no-validate",
                                             "--out", w / "m.onnx"], ["m.onnx"]),
    "build --seed": (lambda v, a, w: ["build", "--config", a["config"], "--seed", v, "--provider", "cpu", "--out",
                                      w / "pkg"], ["pkg"]),
    "parity --batch": (lambda v, a, w: ["parity", "--config", a["config"], "--backends", "torch", "--batch", v,
                                        "--seq", "2", "--json", w / "p.json"], ["p.json"]),
    "parity --seq": (lambda v, a, w: ["parity", "--config", a["config"], "--backends", "torch", "--seq", v,
                                      "--json", w / "p.json"], ["p.json"]),
    "parity --max-mem-gb": (lambda v, a, w: ["parity", "--config", a["config"], "--backends", "torch", "--seq", "2",
                                             "--max-mem-gb", v, "--json", w / "p.json"], ["p.json"]),
    "bench --repeat": (lambda v, a, w: ["bench", "--config", a["config"], *QUICK_BENCH, "--repeat", v, "--json",
                                        w / "b.json"], ["b.json"]),
    "bench --warmup": (lambda v, a, w: ["bench", "--config", a["config"], *QUICK_BENCH, "--warmup", v, "--json",
                                        w / "b.json"], ["b.json"]),
    "bench --threads": (lambda v, a, w: ["bench", "--config", a["config"], *QUICK_BENCH, "--threads", v, "--json",
                                         w / "b.json"], ["b.json"]),
    "bench --timeout": (lambda v, a, w: ["bench", "--config", a["config"], *QUICK_BENCH, "--timeout", v, "--json",
                                         w / "b.json"], ["b.json"]),
    "bench --seq": (lambda v, a, w: ["bench", "--config", a["config"], *QUICK_BENCH, "--seq", v, "--json",
                                     w / "b.json"], ["b.json"]),
    "optimize --auto-seq": (lambda v, a, w: ["optimize", a["model"], "--attention", "measure", "--auto-seq", v,
                                             "--out", w / "o.onnx"], ["o.onnx"]),
    "import --layer": (lambda v, a, w: ["import", a["checkpoint"], "--layer", v, "--out", w / "imp"], ["imp"]),
    "generate --max-new-tokens": (lambda v, a, w: ["generate", a["model_pkg"], "--prompts", a["prompts"],
                                                   "--max-new-tokens", v, "--out", w / "o.jsonl"], ["o.jsonl"]),
    "generate --max-batch": (lambda v, a, w: ["generate", a["model_pkg"], "--prompts", a["prompts"], "--max-batch", v,
                                              "--out", w / "o.jsonl"], ["o.jsonl"]),
    "generate --temperature": (lambda v, a, w: ["generate", a["model_pkg"], "--prompts", a["prompts"],
                                                "--temperature", v, "--out", w / "o.jsonl"], ["o.jsonl"]),
    "generate --top-p": (lambda v, a, w: ["generate", a["model_pkg"], "--prompts", a["prompts"], "--temperature",
                                          "1", "--top-p", v, "--out", w / "o.jsonl"], ["o.jsonl"]),
}  # fmt: skip
# Valid values that run the whole command: kept to the classes where that is cheap.
SLOW_AND_VALID = {("build --seed", "zero"), ("build --seed", "huge"), ("export --max-mem-gb", "huge"),
                  ("export --max-mem-gb", "huge-float"), ("parity --max-mem-gb", "huge"),
                  ("parity --max-mem-gb", "huge-float"), ("bench --timeout", "huge"),
                  ("bench --timeout", "huge-float")}  # fmt: skip


@pytest.mark.parametrize("cls", VALUE_CLASSES)
@pytest.mark.parametrize("case", list(NUMERIC_CASES))
@NUMBER_SETTINGS
@given(data=st.data())
def test_a_bad_number_is_refused_or_honoured(assets, tmp_path_factory, case, cls, data):
    argv, outputs = NUMERIC_CASES[case]
    value = data.draw(_values(cls) if (case, cls) not in SLOW_AND_VALID else st.just("0" if cls == "zero" else "1e6"))
    work = tmp_path_factory.mktemp("number")
    before = {}
    for name in outputs:
        out = str(work / name)
        if name not in FOLDER_OUTPUTS:
            with open(out, "wb") as f:
                f.write(SENTINEL)
        before[out] = snapshot(out)
    outcome = run_cli(argv(str(value), assets, work))
    assert_contract(outcome, before, complete)
