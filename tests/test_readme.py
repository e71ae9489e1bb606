"""The README is the front door: the two commands run as written, it stays short, and each main use reaches its
page of the docs in one click. Its python and bash blocks run in tests/test_docs.py with every page's."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    README = f.read()


def test_the_readme_is_a_front_door():
    """At most 150 lines (issue 32), with a python block (run by tests/test_docs.py)."""
    assert len(README.splitlines()) <= 150
    assert re.search(r"^```python\n", README, re.M)


def test_each_main_use_reaches_its_page():
    """From the README alone, each main use links to its page, and every link to a file names one that exists."""
    for page in ("docs/getting-started.md", "docs/how-to/export.md", "docs/how-to/import.md",
                 "docs/how-to/build-verify.md", "docs/how-to/decode.md", "docs/how-to/audit.md",
                 "docs/how-to/localise.md", "docs/how-to/matrix.md", "docs/how-to/gpu-check.md",
                 "docs/how-to/benchmark.md", "measurements/README.md"):  # fmt: skip
        assert f"]({page})" in README, page
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert os.path.exists(os.path.join(ROOT, target)), target


@pytest.mark.slow
def test_the_main_command_runs_twice(tmp_path):
    """The README's main job, as written after the install step, twice in one folder: the second
    run replaces the package the first one built (an existing pkg is not an error with --force)."""
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", README, flags=re.S).group(1)
    (line,) = [ln for ln in block.splitlines() if ln.startswith("bash .ci/install && ")]
    steps = line.removeprefix("bash .ci/install && ").split(" && ")
    assert [s.split()[:2] for s in steps] == [[".venv/bin/attnx", "build"], [".venv/bin/attnx", "verify"]]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for _ in range(2):
        for step in steps:  # this environment's attnx in place of .venv/bin/attnx
            args = [sys.executable, "-m", "attnx.cli", *step.split()[1:]]
            r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, (step, r.stderr[-2000:])
    assert "verify PASSED" in r.stdout
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        ignored = f.read().split()
    assert "/pkg/" in ignored  # what the main job leaves in a checkout is not for git
