"""Files per term: the product files in which a term's name appears as an identifier (a name or an attribute;
comments and strings left out, as issue 39 counts them), and the longest product file.

    python measurements/term_files/count.py [--json OUT]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRODUCT = ("attnx", "model", "export", "runtimes", "workflows", "bench", "matrix")
TERMS = ("softcap", "sinks", "qk_norm", "sliding_window", "alibi", "qk_l2_norm", "attn_temperature", "attention_chunk")


def product_files() -> list[str]:
    out = []
    for top in PRODUCT:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            out += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(out)


def names(path: str) -> set[str]:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tokens = tokenize.generate_tokens(io.StringIO(f.read()).readline)
        return {t.string for t in tokens if t.type == tokenize.NAME}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    files = product_files()
    by_file = {f: names(f) for f in files}
    result = {"terms": {t: sorted(f for f in files if t in by_file[f]) for t in TERMS},
              "longest": max((sum(1 for _ in open(os.path.join(ROOT, f), encoding="utf-8")), f) for f in files)}
    for term, where in result["terms"].items():
        print(f"{term:15} {len(where):2} files: {' '.join(where)}")
    print(f"longest product file: {result['longest'][1]} ({result['longest'][0]} lines)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
