"""The decode step against its memory-bandwidth bound, from an `attnx bench --decode --json` file:

    python measurements/decode_bound/plot.py measurements/decode_bound/decode_bound.json measurements/decode_bound/decode_bound.png

One line per step form (flushed caches, the bench's lowest round median), and the bound (bytes per step over
the best large copy of the same run) as a dashed line; log scale, ms against the past length.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(src: str, out: str) -> None:
    with open(src, encoding="utf-8") as f:
        report = json.load(f)
    rows = report["rows"]
    pasts = [r["past"] for r in rows]
    forms = [k.removesuffix(" flushed") for k in rows[0]["times_ms"] if k.endswith(" flushed")]
    fig, ax = plt.subplots(figsize=(8, 5))
    for form in forms:
        ax.plot(pasts, [r["times_ms"][f"{form} flushed"] for r in rows], marker="o", label=form)
    ax.plot(pasts, [r["bound_ms"] for r in rows], "k--", linewidth=2, label="bound (bytes / copy bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(pasts, [str(p) for p in pasts])
    ax.set_xlabel("past (cached tokens)")
    ax.set_ylabel("ms per decode step (caches flushed)")
    c = report["config"]
    ax.set_title(f"decode step, d_model {c['d_model']}, {c['n_heads']} heads, batch 1, {report['threads']} threads, "
                 f"{report['machine']['cpu']}", fontsize=10)  # fmt: skip
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
