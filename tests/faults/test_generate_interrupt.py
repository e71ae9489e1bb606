"""attnx generate interrupted (SIGTERM, Ctrl-C) while it serves: it ends with 143 or 130 and one line, and --out holds
the lines finished so far in the prompts' order, each whole, the first of a run that was not interrupted."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from attnx.runtimes.package import load
from attnx.workflows import build_model_package
from tests.faults.conftest import leftovers, run_process

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_generate_keeps_the_lines_finished_in_order(tmp_path, sig, code):
    pkg = tmp_path / "pkg"
    build_model_package(str(FIXTURES / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"), pkg,
                        checkpoint=str(FIXTURES / "genai" / "llama" / "checkpoint"), core="gqa")  # fmt: skip
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 256, int(n))] for n in rng.integers(2, 40, 3000)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = tmp_path / "o.jsonl"
    proc = run_process(["generate", pkg, "--prompts", tmp_path / "p.jsonl", "--out", out, "--max-new-tokens", "60",
                        "--max-batch", "1"], str(tmp_path),
                       process_group=0, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + 120
    first = proc.stderr.readline()
    while "prompts done" not in first and time.monotonic() < deadline and proc.poll() is None:
        first = proc.stderr.readline()  # the first progress line: a prompt is finished
    assert "prompts done" in first, first
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr and leftovers(str(out)) == []
    lines = out.read_text().splitlines()
    assert 1 <= len(lines) < len(prompts)
    assert f"kept the first {len(lines)} of {len(prompts)} lines in {out}" in stderr
    with load(pkg) as model:
        assert [json.loads(line) for line in lines] == model.generate(prompts[: len(lines)], max_new_tokens=60)
