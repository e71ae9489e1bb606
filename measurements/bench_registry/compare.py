"""The bench_registry run's table: each side's lower of its two runs, per implementation (decode: the
flushed step, ms; prefill: the case's median, ms), and after / before.

    python measurements/bench_registry/compare.py OUTDIR > table.md
"""

from __future__ import annotations

import json
import os
import sys


def _load(out: str, kind: str, side: str) -> list[dict]:
    return [json.load(open(os.path.join(out, f"{kind}-{side}-{r}.json"))) for r in (1, 2)
            if os.path.exists(os.path.join(out, f"{kind}-{side}-{r}.json"))]  # fmt: skip


def decode(out: str) -> dict[tuple[int, str], dict[str, float]]:
    table: dict[tuple[int, str], dict[str, float]] = {}
    for side in ("before", "after"):
        for run in _load(out, "decode", side):
            for row in run["rows"]:
                for key, ms in row["times_ms"].items():
                    if key.endswith(" flushed"):
                        cell = table.setdefault((row["past"], key.removesuffix(" flushed")), {})
                        cell[side] = min(cell.get(side, ms), ms)
    return table


def prefill(out: str) -> dict[tuple[int, str], dict[str, float]]:
    table: dict[tuple[int, str], dict[str, float]] = {}
    for side in ("before", "after"):
        for run in _load(out, "prefill", side):
            for case in run["cases"]:
                if case["status"] == "ok":
                    cell = table.setdefault((case["seq"], f"{case['backend']} {case['attention']}"), {})
                    cell[side] = min(cell.get(side, case["median_ms"]), case["median_ms"])
    return table


def main(out: str) -> None:
    for title, table in (("llama3-8b decode step, flushed (ms)", decode(out)),
                         ("large prefill, batch 1 (ms)", prefill(out))):  # fmt: skip
        print(f"\n{title}\n\n| length | implementation | before | after | after / before |\n|---|---|---|---|---|")
        for (length, impl), cell in sorted(table.items()):
            b, a = cell.get("before"), cell.get("after")
            ratio = f"{a / b:.2f}" if a and b else "-"
            print(f"| {length} | {impl} | {b:.2f} | {a:.2f} | {ratio} |" if a and b else f"| {length} | {impl} | {b} | {a} | - |")


if __name__ == "__main__":
    main(sys.argv[1])
