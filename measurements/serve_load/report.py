"""run.py's JSON as the README's tables (markdown on stdout): one round at a time, each server's runs side by side.

    python measurements/serve_load/report.py measurements/serve_load/serve_load.json [ROUND]
"""

from __future__ import annotations

import json
import sys

ORDER = ("attnx fp32", "attnx fp32 whole prompts", "transformers serve", "llama.cpp f32", "attnx int4", "llama.cpp Q4_0")
RATIOS = (("attnx fp32", "transformers serve"), ("attnx fp32", "llama.cpp f32"), ("attnx int4", "llama.cpp Q4_0"))


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def errors(run: dict) -> int:
    """A request that failed, or whose stream ended with no finish_reason (run.py counts both since the first round;
    that round's run.py counted a stream cut short but closed with `data: [DONE]` as answered)."""
    return sum(1 for r in run["per_request"] if r["error"] or r["finish"] is None)


def main() -> int:
    data = json.loads(open(sys.argv[1]).read())
    turns = data["rounds"][int(sys.argv[2]) if len(sys.argv) > 2 else 0]
    runs = {t["server"]: {r["clients"]: r for r in t.get("runs", [])} for t in turns}
    names = [n for n in ORDER if n in runs]
    clients = sorted({c for r in runs.values() for c in r})

    def cells(fmt) -> list[list[str]]:
        return [[str(c)] + [fmt(runs[n][c]) if c in runs[n] else "-" for n in names] for c in clients]

    print("New tokens per second\n")
    print(table(["clients", *names], cells(lambda r: f"{r['new_tokens_per_s']:.1f}")))
    pairs = [(a, b) for a, b in RATIOS if a in runs and b in runs]
    if pairs:
        print("\nRatios of new tokens per second (same round; - where a server had errors)\n")
    def ratio(a: dict, b: dict) -> str:  # only where both answered every request in full
        return f"{a['new_tokens_per_s'] / b['new_tokens_per_s']:.2f}x" if not errors(a) and not errors(b) else "-"

    rows = [[str(c)] + [ratio(runs[a][c], runs[b][c]) if c in runs[a] and c in runs[b] else "-" for a, b in pairs]
            for c in clients]  # fmt: skip
    if pairs:
        print(table(["clients", *[f"{a} / {b}" for a, b in pairs]], rows))
    print("\nTime to first token, p50 / p99 (s)\n")
    print(table(["clients", *names], cells(lambda r: f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}")))
    print("\nTime between tokens, p50 / p99 (ms)\n")
    print(table(["clients", *names], cells(lambda r: f"{r['tbt_p50_ms']:.1f} / {r['tbt_p99_ms']:.0f}")))
    print("\nErrors; answers equal to the reference's 128 tokens\n")
    print(table(["clients", *names], cells(lambda r: f"{errors(r)}; {r['match_reference']}/{r['requests']}")))
    print("\nLoad average (1 minute) before and after each server's turn\n")
    print(table(["server", "before", "after", "ready (s)"],
                [[t["server"], str(t["before"]["loadavg_1m"]), str(t["after"]["loadavg_1m"]), str(t.get("ready_s"))]
                 for t in turns]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
