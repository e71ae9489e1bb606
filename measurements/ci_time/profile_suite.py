"""Where the suite's CPU goes: a py-spy profile of the whole `bash .ci/run` test command, its workers and every
process they start, summed by process kind, by what the processes import, and by function.

Record (py-spy installed in a venv of its own, `python -m venv /tmp/spy && /tmp/spy/bin/pip install py-spy`; the
docs site built first, as .ci/run builds it):

    site=$(mktemp -d) && .venv/bin/mkdocs build --strict --site-dir $site
    ATTNX_DOCS_SITE=$site CI=true /tmp/spy/bin/py-spy record -r 25 -f raw -o /tmp/suite_prof.txt --subprocesses -- \
        .venv/bin/python -m pytest -q -p no:cacheprovider -n auto --dist loadfile --no-loadscope-reorder

then summarise:

    python measurements/ci_time/profile_suite.py /tmp/suite_prof.txt [--json OUT]

py-spy samples each process's Python stacks (not idle threads) `-r` times a second, so samples / rate is CPU seconds.
Its raw format is one line per stack, `process P:"cmd";...;frame (file:line);... COUNT`, where a command may hold
newlines: records are split at each `process N:"` that starts a line.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

from attnx._io import write_json_atomic

RATE = 25  # samples a second, as recorded above
IMPORT = "_find_and_load"


def records(text: str):
    """(frames, count) of each stack: process frames (`process N:"cmd"`) and Python frames."""
    for rec in re.split(r'\n(?=process \d+:")', text):
        m = re.match(r"(.*) (\d+)$", rec.strip(), re.S)
        if m is None:
            continue
        yield re.split(r';(?=process \d+:"|[^;]* \()', m.group(1)), int(m.group(2))


def kind(command: str) -> str:
    """A started process's kind, from its command line."""
    if "ray" in command and ("ray start" in command or "/ray/" in command or "ray::" in command):
        return "ray"
    if "attnx.cli" in command or "/bin/attnx" in command:
        return "attnx CLI"
    if "bench._worker" in command:
        return "bench worker"
    if "matrix" in command and "worker" in command:
        return "matrix case worker"
    if "_signal_trap" in command:
        return "signal trap"
    if command.startswith('"bash'):
        return "bash (docs page blocks)"
    if "python -c" in command:
        return "python -c"
    return "other"


def summarise(text: str) -> dict:
    total = workers = 0
    started = collections.Counter()
    started_imports = collections.Counter()
    pids: dict[str, set[str]] = collections.defaultdict(set)
    functions = collections.Counter()
    compiled = 0
    for frames, n in records(text):
        total += n
        processes = [i for i, f in enumerate(frames) if f.startswith("process ")]
        seen = set()
        for f in frames:
            if not f.startswith("process "):
                key = re.sub(r":\d+\)$", ")", f)
                if key not in seen:
                    functions[key] += n
                    seen.add(key)
        if any(f.startswith("SourceLoader.source_to_code") for f in frames):
            compiled += n
        if len(processes) <= 2:  # pytest's controller and its workers
            workers += n
            continue
        last = frames[processes[-1]]
        k = kind(re.sub(r"^process \d+:", "", last).replace("\n", " "))
        pids[k].add(re.match(r"process (\d+)", last).group(1))
        started[k] += n
        if any(IMPORT in f for f in frames[processes[-1] + 1:]):
            started_imports[k] += n
    s = 1.0 / RATE
    skip = ("pluggy", "_pytest", "execnet", "xdist", "<module>", IMPORT, "_call_with_frames", "_load_unlocked",
            "exec_module", "_handle_fromlist", "_gcd_import", "<frozen runpy>")  # fmt: skip
    return {
        "cpu_s": round(total * s, 1),
        "workers_s": round(workers * s, 1),
        "started_processes_s": round((total - workers) * s, 1),
        "started_imports_s": round(sum(started_imports.values()) * s, 1),
        "compiling_sources_s": round(compiled * s, 1),
        "started": {k: {"s": round(v * s, 1), "imports_s": round(started_imports[k] * s, 1), "processes": len(pids[k])}
                    for k, v in started.most_common()},
        "functions_s": {k: round(v * s, 1) for k, v in functions.most_common(400)
                        if not any(x in k for x in skip)},
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile")
    p.add_argument("--json", default=None)
    p.add_argument("--functions", type=int, default=40, help="how many functions to print")
    args = p.parse_args()
    result = summarise(Path(args.profile).read_text(encoding="utf-8", errors="replace"))
    print(f"CPU {result['cpu_s']} s: workers {result['workers_s']} s, started processes {result['started_processes_s']}"
          f" s (their imports {result['started_imports_s']} s); compiling sources {result['compiling_sources_s']} s")
    for k, v in result["started"].items():
        print(f"  {k:24} {v['s']:7.1f} s  imports {v['imports_s']:6.1f} s  processes {v['processes']}")
    for k, v in list(result["functions_s"].items())[: args.functions]:
        print(f"  {v:7.1f} s  {k}")
    if args.json:
        result["functions_s"] = dict(list(result["functions_s"].items())[:60])
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
