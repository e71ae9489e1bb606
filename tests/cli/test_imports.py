"""What each command imports (docs/reference/behaviour.md): the deployment commands (verify, run,
inspect) never import torch, onnxscript or onnx-ir (inspect of a model file not even onnx or
onnxruntime), and `attnx --help` imports no heavy library at all, in an environment that has them
all. Each is a fresh process: sys.modules after the command is what a user's call paid for."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from attnx.cli import main

# The libraries of the export side (torch and its kin), and every other heavy one.
EXPORT_SIDE = ("torch", "onnxscript", "onnx_ir", "safetensors")
HEAVY = (*EXPORT_SIDE, "onnx", "ml_dtypes", "onnxruntime", "openvino", "ray", "matplotlib", "transformers")

PROBE = """
import json, sys
from attnx.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:  # --help
    rc = e.code
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r}))
print("IMPORTED " + json.dumps({{"rc": rc, "heavy": heavy}}), file=sys.stderr)
"""


def imported(*args: str) -> tuple[int, list[str]]:
    """(exit status, the heavy libraries among sys.modules) of `attnx ARGS` in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("IMPORTED ")), None)
    assert line is not None, proc.stderr[-2000:]
    result = json.loads(line[len("IMPORTED ") :])
    return result["rc"], result["heavy"]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    root = tmp_path_factory.mktemp("imports")
    assert main(["build", "--preset", "tiny", "--provider", "cpu", "--out", str(root / "pkg")]) == 0
    np.save(root / "x.npy", np.zeros((1, 3, 64), np.float32))
    return root


def test_help_imports_no_heavy_library():
    assert imported("--help") == (0, [])


@pytest.mark.parametrize("command", ["verify", "run", "inspect"])
def test_a_deployment_command_imports_nothing_of_the_export_side(package, tmp_path, command):
    pkg = str(package / "pkg")
    args = {"verify": ["verify", pkg],
            "run": ["run", pkg, "--input", str(package / "x.npy"), "--output", str(tmp_path / "y.npy")],
            "inspect": ["inspect", str(package / "pkg" / "model.onnx")]}[command]  # fmt: skip
    rc, heavy = imported(*args)
    assert rc == 0
    assert not set(heavy) & set(EXPORT_SIDE), heavy
    assert "onnxruntime" in heavy or command == "inspect"  # the probe sees what a command loads
    # inspect reads the file alone: no runtime, and not onnx, whose package loads ml_dtypes (0.55 s
    # on an AMD EPYC: measurements/inspect_startup.md)
    assert heavy == [] or command != "inspect", heavy
