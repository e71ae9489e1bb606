"""Run one attnx command under /usr/bin/time -v, stamping each `auditing block N` line it prints and sampling
its resident memory (VmRSS, twice a second), and write what it cost as JSON: wall seconds, peak RSS (time's
"Maximum resident set size"), each block's seconds and the RSS when each block began.

    python measurements/audit_scale/measure.py --label NAME --json OUT.json -- attnx audit MODEL ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import threading
import time


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    started = time.time()
    proc = subprocess.Popen(["/usr/bin/time", "-v", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    samples: list[tuple[float, int]] = []
    child: list[int] = []

    def sample() -> None:  # the command's own process: /usr/bin/time's only child
        while proc.poll() is None:
            if not child:
                try:
                    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                        child.extend(int(p) for p in f.read().split())
                except OSError:
                    pass
            if child and (kb := rss_kb(child[0])) is not None:
                samples.append((time.time() - started, kb))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    blocks, stderr = [], []
    for line in proc.stderr:  # type: ignore[union-attr]
        stderr.append(line)
        m = re.match(r"auditing block (\d+)", line)
        if m:
            blocks.append({"block": int(m.group(1)), "start_s": round(time.time() - started, 2),
                           "rss_kb_at_start": samples[-1][1] if samples else None})  # fmt: skip
    stdout = proc.stdout.read()  # type: ignore[union-attr]
    proc.wait()
    wall = time.time() - started
    sampler.join()
    for this, after in zip(blocks, blocks[1:] + [{"start_s": wall}]):
        this["seconds"] = round(after["start_s"] - this["start_s"], 2)
    timed = {k.strip(): v.strip() for k, v in (ln.split(": ", 1) for ln in stderr if ": " in ln and ln.startswith("\t"))}
    result = {
        "label": args.label, "command": " ".join(command), "rc": proc.returncode, "wall_s": round(wall, 2),
        "peak_rss_kb": int(timed.get("Maximum resident set size (kbytes)", 0)),
        "sampled_peak_rss_kb": max((kb for _, kb in samples), default=None),
        "user_s": float(timed.get("User time (seconds)", 0)), "system_s": float(timed.get("System time (seconds)", 0)),
        "first_block_s": blocks[0]["start_s"] if blocks else None, "blocks": blocks,
        "stdout_tail": stdout.splitlines()[-6:], "loadavg_after": os.getloadavg(),
    }  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "blocks"}, indent=1))


if __name__ == "__main__":
    main()
