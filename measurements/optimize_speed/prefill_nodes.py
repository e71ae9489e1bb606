"""Where a model's prefill goes, node by node: ONNX Runtime's own profile of run.py's models at one case, each node's
kernel time (the median over the runs), and the sums by op type and by block. What tells apart two models whose
totals this host's noise cannot: run.py and prefill_interleaved.py time whole runs; this says which nodes differ.

    python measurements/optimize_speed/prefill_nodes.py [--work DIR] [--case "prefill 512"] [--runs 8] [--json OUT]
                                                        [--models "attnx optimize,GenAI builder fp32"]

It reads the models run.py made under --work (run run.py first); it builds nothing. 2 intra-op threads, batch 1, two
warm-up runs before the profiled ones.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from attnx._io import write_json_atomic

HERE = Path(__file__).resolve().parent


def profile(path: Path, feeds: dict[str, np.ndarray], runs: int) -> dict[str, object]:
    """{"run_ms": median of model_run, "nodes": {name: {"op", "ms", "shapes"}}} of `runs` runs after two warm-up runs
    (each node's time: the median of its times in those runs)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(os.environ.get("TMPDIR", "/tmp")) / "attnx-prefill-nodes")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    fed = {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
    for _ in range(2 + runs):
        session.run(None, fed)
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    run_ms = [e["dur"] / 1e3 for e in events if e.get("name") == "model_run"][2:]
    times: dict[str, list[float]] = collections.defaultdict(list)
    nodes: dict[str, dict[str, object]] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            times[name].append(e["dur"] / 1e3)
            nodes[name] = {"op": e["args"]["op_name"], "shapes": e["args"].get("output_type_shape")}
    for name, values in times.items():
        nodes[name]["ms"] = float(np.median(values[2:] or values))
    return {"run_ms": float(np.median(run_ms)), "nodes": nodes}


def block_of(name: str) -> str:
    """The layer a node belongs to, from its name (attnx's attnx/blockN/..., the builder's /model/layers.N/...), or
    "outside" (the export's node_* names say none)."""
    m = re.search(r"attnx/block(\d+)/|layers\.(\d+)/", name)
    return f"layer {m.group(1) or m.group(2)}" if m else "outside"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/attnx-optimize-speed")
    p.add_argument("--case", default="prefill 512")
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--models", default="attnx optimize,GenAI builder fp32")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    import run  # run.py's models and feeds

    work = Path(args.work)
    paths = run.model_paths(work)
    config = json.loads((work / "checkpoint" / "config.json").read_text())
    tokens, past, _ = run.CASES[args.case]
    feeds = run.case_feeds(config, tokens, past)
    result = {"cpu": run.cpu(), "date": datetime.date.today().isoformat(), "case": args.case, "runs": args.runs,
              "command": "python measurements/optimize_speed/prefill_nodes.py " + " ".join(sys.argv[1:]),
              "models": {}}  # fmt: skip
    for name in args.models.split(","):
        prof = profile(paths[name], feeds, args.runs)
        by_op, by_block = collections.Counter(), collections.Counter()
        for node, info in prof["nodes"].items():
            by_op[info["op"]] += info["ms"]
            by_block[block_of(node)] += info["ms"]
        result["models"][name] = {"run_ms": prof["run_ms"], "nodes": len(prof["nodes"]),
                                  "by_op_ms": dict(by_op.most_common()), "by_block_ms": dict(by_block.most_common()),
                                  "node_ms": {k: v["ms"] for k, v in sorted(prof["nodes"].items(),
                                                                            key=lambda kv: -kv[1]["ms"])}}  # fmt: skip
        print(f"{name}: run {prof['run_ms']:.1f} ms, {len(prof['nodes'])} nodes; by op: "
              + ", ".join(f"{op} {ms:.2f}" for op, ms in by_op.most_common(12)))
    if args.json:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
