"""The fault-injection suite: what every CLI path promises when its input is bad or it is stopped.

The promise (docs/reference/behaviour.md, "Exit codes and errors" and "Nothing is half-written"), checked for every generated case:
- the exit status is 0 (then the output is complete and checked) or one of 1, 2, 130, 143;
- stderr holds at most one line that says "error", and never a traceback; a failed run says why
  in that line, or (a check that ran and failed, exit 1) in its report on stdout;
- the output is either untouched (byte for byte what was there before, or still absent) or
  complete, and nothing is left beside it (no `.NAME.partial-*` stage, no `.NAME.lock`).

Coverage is enumerated, the values generated: every (argument, fault kind) and every (numeric
argument, class of value) is a test case of its own (pytest parametrize), so each runs on every
run; hypothesis draws the bytes, offsets and numbers within a case. A fault kind that takes no
drawn value (missing, empty, a folder, a symlink out, a file of the wrong kind) runs once; the
default profile draws the fewest examples that still vary what a case can vary (random bytes and
truncations: 3; a number: 1 per class, the classes split so that one value stands for its class);
ATTNX_FAULTS=long draws many more of each (`ATTNX_FAULTS=long bash .ci/run tests/faults`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from attnx.cli import main

PROFILE = os.environ.get("ATTNX_FAULTS", "default")
settings.register_profile(
    "faults-default", max_examples=3, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
settings.register_profile(
    "faults-long", max_examples=200, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
FAULT_SETTINGS = settings.get_profile(f"faults-{PROFILE}")
# A number: one per class by default (a class is one kind of value: its parsing and its check are
# one path); a valid one runs the whole command (an export, a sweep).
NUMBER_SETTINGS = settings(FAULT_SETTINGS, max_examples=1 if PROFILE == "default" else 50)

ALLOWED = {0, 1, 2, 130, 143}
SENTINEL = b"what was here before the command ran\n"
TINY_CONFIG = '{"d_model": 16, "n_heads": 2, "key_padding_mask": true}'
STEP_CONFIG = '{"d_model": 16, "n_heads": 2, "n_kv_heads": 1, "causal": true, "kv_cache": true}'


@dataclasses.dataclass
class Outcome:
    rc: int
    out: str
    err: str

    def error_lines(self) -> list[str]:
        """The lines of stderr that say "error", progress lines ("[  1.0s] ... rel RMS error of each
        case") left out: they describe the work, not a failure."""
        return [line for line in self.err.splitlines() if "error" in line.lower() and not _is_progress(line)]

    def reason_lines(self) -> list[str]:
        """attnx's own lines on stderr ("attnx CMD: error: ...", "attnx CMD: interrupted ..."):
        not progress ("[  1.0s] ...") nor a library's warning."""
        return [line for line in self.err.splitlines() if line.startswith("attnx ") and ": warning: " not in line]


def _is_progress(line: str) -> bool:
    """A progress line: "[   1.0s] message" (attnx.commands._common.Progress, bench's bar)."""
    head = line.split("]", 1)[0]
    return line.startswith("[") and head[1:].strip().endswith("s") and "]" in line


def run_cli(args: list[str]) -> Outcome:
    """attnx in this process, as the console script runs it (argparse's exit included)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse: bad usage
            rc = e.code if isinstance(e.code, int) else 2
    return Outcome(rc, out.getvalue(), err.getvalue())


def run_process(args: list[str], cwd: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "attnx.cli", *map(str, args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)  # fmt: skip


def leftovers(path: str) -> list[str]:
    """What a writer of `path` may have left beside it: stages and locks."""
    parent, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if not os.path.isdir(parent):
        return []
    return sorted(e for e in os.listdir(parent) if e.startswith((f".{name}.partial-", f".{name}.lock")))


def snapshot(path: str) -> object:
    """What is at `path` now: None, a file's bytes, or a folder's {name: bytes}."""
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path):
        return {n: snapshot(os.path.join(path, n)) for n in sorted(os.listdir(path))}
    with open(path, "rb") as f:
        return f.read()


# Outputs that are reports: a check that ran and failed (1) writes its report (parity, verify,
# bench --json), and bench's is rewritten as the work goes (Ctrl-C, 130/143, keeps what was
# measured). Refused input (2) leaves them untouched like any other output.
REPORTS = {1: ("p.json", "v.json", "b.json"), 130: ("b.json",), 143: ("b.json",)}


def assert_contract(outcome: Outcome, outputs: dict[str, object], complete) -> None:
    """The promise, for one run. outputs: {output path: its snapshot before the run};
    complete(path) checks a written output when the run says it succeeded."""
    assert outcome.rc in ALLOWED, (outcome.rc, outcome.err[-2000:])
    assert "Traceback" not in outcome.err, outcome.err[-3000:]
    errors = outcome.error_lines()
    assert len(errors) <= 1, outcome.err[-2000:]
    if outcome.rc == 1 and not errors:  # a check that ran and failed says so in its report, on stdout
        assert any(word in outcome.out for word in ("FAIL", " failed", " timeout")), outcome.out[-2000:]
    elif outcome.rc != 0:
        assert len(outcome.reason_lines()) == 1, (outcome.rc, outcome.err[-2000:])  # the one line that says why
    for path, before in outputs.items():
        assert leftovers(path) == [], leftovers(path)
        if snapshot(path) == before:
            continue
        assert outcome.rc == 0 or path.endswith(REPORTS.get(outcome.rc, ())), (
            f"{path} changed by a run that failed ({outcome.rc}): {outcome.err[-1500:]}"
        )
        complete(path)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    """Valid files of every kind the CLI reads, small: a config, weights, a model, a package, inputs."""
    from attnx.model import AttentionConfig, init_weights, save_weights

    root = tmp_path_factory.mktemp("fault-assets")
    config = AttentionConfig.from_json(TINY_CONFIG)
    (root / "c.json").write_text(TINY_CONFIG)
    save_weights(init_weights(config, 2), root / "w.safetensors")
    assert main(["export", "--config", str(root / "c.json"), "--out", str(root / "m.onnx"), "--no-validate"]) == 0
    assert main(["build", "--config", str(root / "c.json"), "--out", str(root / "pkg"), "--provider", "cpu"]) == 0
    rng = np.random.default_rng(0)
    os.mkdir(root / "ckpt")  # a Hugging Face checkpoint folder (BERT layout), as attnx import reads one
    (root / "ckpt" / "config.json").write_text('{"model_type": "bert", "hidden_size": 16, "num_attention_heads": 2}')
    from safetensors.numpy import save_file

    save_file({f"encoder.layer.0.attention.{p}.{t}": rng.standard_normal((16, 16) if t == "weight" else 16,
                                                                          dtype=np.float32)
               for p in ("self.query", "self.key", "self.value", "output.dense") for t in ("weight", "bias")},
              root / "ckpt" / "model.safetensors")  # fmt: skip
    np.save(root / "x.npy", rng.standard_normal((2, 3, 16), dtype=np.float32))
    np.save(root / "k.npy", np.zeros((2, 3), dtype=bool))
    # A step model (kv_cache) and a cache of 3 positions for it (attnx run --past-key/--past-value).
    (root / "step.json").write_text(STEP_CONFIG)
    assert main(["export", "--config", str(root / "step.json"), "--out", str(root / "step.onnx"), "--no-validate"]) == 0
    np.save(root / "pk.npy", rng.standard_normal((2, 1, 3, 8), dtype=np.float32))
    np.save(root / "pv.npy", rng.standard_normal((2, 1, 3, 8), dtype=np.float32))
    np.save(root / "x1.npy", rng.standard_normal((2, 1, 16), dtype=np.float32))
    # a whole model another tool exported (torch.onnx's tiny llama), its package, and prompts for attnx generate
    fixtures = Path(__file__).resolve().parents[1] / "fixtures"
    foreign = fixtures / "exported" / "torch-dynamo" / "llama" / "sdpa-opset20" / "model.onnx"
    assert main(["build", "--model", str(foreign), "--checkpoint", str(fixtures / "genai" / "llama" / "checkpoint"),
                 "--core", "gqa", "--out", str(root / "mpkg")]) == 0  # fmt: skip
    (root / "p.jsonl").write_text("[1, 2, 3]\n[40, 50]\n")
    return {
        "config": root / "c.json", "weights": root / "w.safetensors", "model": root / "m.onnx",
        "package": root / "pkg", "npy": root / "x.npy", "mask": root / "k.npy", "checkpoint": root / "ckpt",
        "step": root / "step.onnx", "past": root / "pk.npy", "past_value": root / "pv.npy", "x1": root / "x1.npy",
        "foreign": foreign, "model_pkg": root / "mpkg", "prompts": root / "p.jsonl",
    }  # fmt: skip


def make_fault(kind: str, path: str, valid, data: bytes, fraction: float, other) -> None:
    """Put a bad input of `kind` at `path`: missing, empty, random bytes, a valid file truncated,
    a folder, a symlink out of the work folder, a valid file of another kind."""
    if kind == "missing":
        return
    if kind == "empty":
        open(path, "wb").close()
    elif kind == "random":
        with open(path, "wb") as f:
            f.write(data)
    elif kind == "truncated":
        if os.path.isdir(valid):  # a package: one of its files cut short
            shutil.copytree(valid, path)
            member = sorted(os.listdir(path))[int(fraction * 1e6) % len(os.listdir(path))]
            target = os.path.join(path, member)
        else:
            shutil.copyfile(valid, path)
            target = path
        size = os.path.getsize(target)
        with open(target, "r+b") as f:
            f.truncate(min(int(fraction * size), max(size - 1, 0)))
    elif kind == "folder":
        os.mkdir(path)
    elif kind == "symlink-out":
        os.symlink("/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd", path)
    elif kind == "wrong-kind":
        (shutil.copytree if os.path.isdir(other) else shutil.copyfile)(other, path)
    else:  # pragma: no cover
        raise ValueError(kind)


FAULT_KINDS = ("missing", "empty", "random", "truncated", "folder", "symlink-out", "wrong-kind")
# The kinds whose file depends on drawn values (the bytes, the offset of the cut).
DRAWN_KINDS = ("random", "truncated")
