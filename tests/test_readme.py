"""The README is the contract: its Python blocks run as written, and what it says of the CLI and
the layout matches the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    README = f.read()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_the_generated_tables_are_the_registrys():
    """The README's tables of terms, lowerings and cores are the registry's (attnx.model.cores), as
    update_readme() writes them: python -c "from attnx.model.cores import update_readme; ..." rewrites them."""
    from attnx.model.cores import README_BLOCKS, update_readme

    for name in README_BLOCKS:
        assert f"<!-- generated: {name} -->" in README
    assert update_readme(README) == README, "the README's generated tables differ from the registry: run update_readme"


def test_the_readme_has_python_blocks():
    assert PYTHON_BLOCKS


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"block{i}" for i in range(len(PYTHON_BLOCKS))])
def test_python_block_runs_as_written(block, tmp_path):
    """In a fresh interpreter and an empty folder, as a reader would paste it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


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
