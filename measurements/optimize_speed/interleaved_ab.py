"""Any models of run.py's checkpoint, one of run.py's cases (the prefill of 512 by default) interleaved run by run, as
prefill_interleaved.py times run.py's four: for an A/B of two builds of attnx's model (the blocks' tables shared or
not, say) beside the builder's.

    python measurements/optimize_speed/interleaved_ab.py [--work DIR] [--iterations 100] [--case "prefill 512"]
                                                         NAME=MODEL.onnx [NAME=MODEL.onnx ...]

The first model named is the base: every ratio is a model's time over the base's in the same iteration (median,
bootstrap 95% interval). Sessions without spinning, 2 threads, batch 1; the logits of each against the base's are
printed first. It builds nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/attnx-optimize-speed", help="run.py's folder (its checkpoint's config)")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--case", default="prefill 512", help="one of run.py's CASES")
    p.add_argument("models", nargs="+", help="NAME=PATH, the base first")
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    import run  # run.py's sessions and feeds
    from prefill_interleaved import interleave, ratio_ci  # its loop and its interval

    paths = dict(m.split("=", 1) for m in args.models)
    base = next(iter(paths))
    config = json.loads((Path(args.work) / "checkpoint" / "config.json").read_text())
    tokens, past, _ = run.CASES[args.case]
    feeds = run.case_feeds(config, tokens, past)
    models = {name: run.session(Path(path), spin=False) for name, path in paths.items()}
    fed = {k: {n: v for n, v in feeds.items() if n in {i.name for i in s.get_inputs()}} for k, s in models.items()}
    logits = {k: s.run(None, fed[k])[0] for k, s in models.items()}
    for k in logits:
        print(f"{k}: logits max |difference| from {base}'s {float(np.abs(logits[k] - logits[base]).max()):.3g}")
    times = interleave(models, fed, args.iterations)
    print(f"{run.cpu()['model']}, 2 threads, batch 1, {args.case}, {args.iterations} interleaved iterations")
    first, rng = np.array(times[base]), np.random.default_rng(0)
    for k, values in times.items():
        ratio, low, high = ratio_ci(np.array(values) / first, rng)
        print(f"{k:16} median {np.median(values):7.1f} ms; / {base} {ratio:.3f} (95% {low:.3f}-{high:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
