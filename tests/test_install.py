"""The deployment side installs without torch: a fresh virtual environment with attnx from this
source and only its base dependencies and a runtime (numpy, onnx, onnxruntime), offline,
verifies, runs, inspects and loads a package, and says what to install for the rest.

Offline: the runtime's distributions are not downloaded but linked from this environment (their
top-level packages and metadata, each dependency of theirs included), and attnx is installed
from a copy of this checkout with --no-index --no-deps. `pip check` then holds attnx's own
requirements against what is there: a base dependency on torch (or on anything but numpy and
onnx) would fail it.
"""

from __future__ import annotations

import glob
import importlib.metadata as md
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from packaging.requirements import Requirement

from attnx.model import init_weights, reference_attention
from attnx.model.tolerance import problem_size, tolerance_for
from attnx.runtimes import compare_arrays
from attnx.workflows import build_package
from tests.conftest import CONFIGS

# the slow tier: the install in a fresh virtual environment
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPORT_SIDE = ("torch", "onnx_ir", "onnxscript", "safetensors")


def _runtime_distribution() -> str:
    for name in ("onnxruntime-gpu", "onnxruntime"):
        try:
            md.distribution(name)
            return name
        except md.PackageNotFoundError:
            continue
    pytest.skip("no onnxruntime installed here to link into the environment")


def _closure(names: list[str]) -> list[md.Distribution]:
    """The distributions `names` need to run, their own dependencies included (no extras)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        dist = md.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _link_distributions(dists: list[md.Distribution], folder: str) -> None:
    """Each distribution's top-level files and folders (its packages and its .dist-info), linked."""
    os.makedirs(folder)
    for dist in dists:
        tops = {str(f).split("/")[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = os.path.join(str(dist.locate_file("")), top)
            target = os.path.join(folder, top)
            if os.path.exists(source) and not os.path.lexists(target) and top != "__pycache__":
                os.symlink(source, target)


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory):
    """A venv with attnx's runtime side only; its bin folder."""
    tmp = tmp_path_factory.mktemp("runtime-side")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    (site,) = glob.glob(str(venv / "lib" / "python*" / "site-packages"))
    # numpy and onnx are attnx's base dependencies; setuptools is only what builds attnx here.
    _link_distributions(_closure(["numpy", "onnx", _runtime_distribution()]) + [md.distribution("setuptools")],
                        str(tmp / "linked"))  # fmt: skip
    with open(os.path.join(site, "linked-runtime.pth"), "w", encoding="utf-8") as f:
        f.write(str(tmp / "linked") + "\n")
    source = tmp / "attnx-source"  # a copy of the checkout: building writes build/ and egg-info into it
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        if os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(source / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), source / rel)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    # the venv's own old setuptools would shadow the linked one (which builds wheels by itself)
    subprocess.run([*pip, "uninstall", "-y", "setuptools"], check=True, timeout=300, cwd=tmp)
    subprocess.run([*pip, "install", "--no-index", "--no-deps", "--no-build-isolation", str(source)], check=True,
                   timeout=600, cwd=tmp)  # fmt: skip
    return venv / "bin"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    out = tmp_path_factory.mktemp("pkg") / "pkg"
    build_package(CONFIGS["kpm"], out, init_weights(CONFIGS["kpm"], 3), providers=["cpu"])
    return out


def _run(bin_dir, *args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run([*args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_runtime_side_has_no_torch_and_its_requirements_hold(runtime_venv, tmp_path):
    python = str(runtime_venv / "python")
    for module in EXPORT_SIDE:
        r = _run(runtime_venv, python, "-c", f"import {module}", cwd=tmp_path)
        assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr, (module, r.stderr)
    r = _run(runtime_venv, python, "-m", "pip", "check", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr  # attnx's base requirements are all here: no torch among them
    r = _run(runtime_venv, python, "-c", "import attnx, onnxruntime; print(attnx.__file__)", cwd=tmp_path)
    assert r.returncode == 0 and "site-packages" in r.stdout, r.stderr  # the installed copy, not this checkout


def test_the_runtime_side_verifies_runs_inspects_and_loads_a_package(runtime_venv, package, tmp_path):
    attnx = str(runtime_venv / "attnx")
    r = _run(runtime_venv, attnx, "verify", str(package), cwd=tmp_path)
    assert r.returncode == 0 and "verify PASSED (cpu)" in r.stdout, r.stdout + r.stderr

    config, weights = CONFIGS["kpm"], init_weights(CONFIGS["kpm"], 3)
    x = np.random.default_rng(5).standard_normal((2, 6, config.d_model)).astype(np.float32)
    mask = np.zeros((2, 6), dtype=bool)
    mask[0, 4:] = True
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "k.npy", mask)
    r = _run(runtime_venv, attnx, "run", str(package), "--input", "x.npy", "--key-padding-mask", "k.npy",
             "--output", "y.npy", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    feeds = {"x": x, "key_padding_mask": mask}
    ref = reference_attention(config, weights, **feeds)
    cmp = compare_arrays("y", np.load(tmp_path / "y.npy"), ref, tolerance_for("fp32"), problem_size(config, weights, feeds))
    assert cmp, cmp

    r = _run(runtime_venv, attnx, "inspect", str(package / "model.onnx"), "--json", cwd=tmp_path)
    assert r.returncode == 0 and '"lowering": "ort-fused"' in r.stdout, r.stderr
    code = f"import attnx\nwith attnx.load({str(package)!r}) as r:\n    print(r.name, r.inputs[0].dtype)"
    r = _run(runtime_venv, str(runtime_venv / "python"), "-c", code, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["ort-cpu", "fp32"], r.stderr


@pytest.mark.parametrize(
    ("args", "missing"),
    [(["export", "--preset", "tiny", "--out", "m.onnx"], "torch"),
     (["build", "--preset", "tiny", "--out", "p"], "torch"),
     (["optimize", "m.onnx", "--out", "o.onnx"], "onnx-ir, onnxscript")],
)  # fmt: skip
def test_the_export_side_says_what_to_install(runtime_venv, tmp_path, args, missing):
    r = _run(runtime_venv, str(runtime_venv / "attnx"), *args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert missing in line and "pip install 'attnx[export]'" in line and "Traceback" not in r.stderr
    assert not os.listdir(tmp_path)  # nothing written
