"""The packaging of ONNX Runtime GenAI's int4 CPU model by attnx, each step under `/usr/bin/time -v` (wall seconds,
peak RSS): optionally the builder's model itself (--builder-out: `python -m onnxruntime_genai.models.builder -i CKPT -o
OUT -p int4 -e cpu`, in the GenAI venv), then `attnx build --model MODEL --checkpoint CKPT --out PKG --force`,
`attnx verify PKG`, and `attnx generate PKG --prompts P.jsonl --out O.jsonl --max-new-tokens 64` on 8 prompts of
64-256 tokens (run.py's 8-request prompts). Writes one JSON of the steps (the commands, exit codes, seconds, peak RSS,
the last lines each printed) and what the package holds (its files, its decode form as the manifest says).

    python measurements/int4_package/build.py --checkpoint CKPT --model MODEL/model.onnx --out PKG [--work DIR]
        [--builder-out MODEL_DIR --genai-python PY] [--json OUT]

Run it with the venv of the checkout to measure (its attnx beside sys.executable); ATTNX_THREADS is left as set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as throughput  # noqa: E402 - this folder's run.py: prompts_for, cpu, git_commit


def timed(command: list[str], tail: int = 12) -> dict:
    """`command` under /usr/bin/time -v: its exit code, wall seconds, peak RSS (MB), its output's last lines."""
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    text = done.stdout + done.stderr
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    seconds = None
    if wall:
        parts = [float(x) for x in wall.group(1).split(":")]
        seconds = sum(x * 60**i for i, x in enumerate(reversed(parts)))
    lines = [line for line in text.splitlines() if line and not line.startswith("\t")]
    return {"command": " ".join(command), "exit": done.returncode, "wall_s": seconds,
            "peak_rss_mb": int(rss.group(1)) / 1024 if rss else None, "output_tail": lines[-tail:]}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--model", required=True, help="the builder's model.onnx (written first with --builder-out)")
    p.add_argument("--out", required=True, help="the package folder (replaced: --force)")
    p.add_argument("--work", default="/tmp/int4work", help="where the prompts and the generated tokens go")
    p.add_argument("--builder-out", default=None, help="build the GenAI int4 model here first")
    p.add_argument("--genai-python", default="/tmp/int4work/genai-venv/bin/python")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    attnx = str(Path(sys.executable).parent / "attnx")
    steps = {}
    if args.builder_out:
        steps["builder int4"] = timed([args.genai_python, "-m", "onnxruntime_genai.models.builder", "-i",
                                       args.checkpoint, "-o", args.builder_out, "-p", "int4", "-e", "cpu"], tail=3)  # fmt: skip
    steps["attnx build"] = timed([attnx, "build", "--model", args.model, "--checkpoint", args.checkpoint, "--out",
                                  args.out, "--force"], tail=40)  # fmt: skip
    for name, step in steps.items():
        print(f"{name}: exit {step['exit']}, {step['wall_s']} s, peak RSS {step['peak_rss_mb']:.0f} MB", flush=True)
    if steps["attnx build"]["exit"] != 0:
        print("\n".join(steps["attnx build"]["output_tail"]))
    else:
        steps["attnx verify"] = timed([attnx, "verify", args.out])
        manifest = json.loads((Path(args.out) / "manifest.json").read_text())
        prompts = throughput.prompts_for(8, manifest["vocab"])
        work = Path(args.work)
        prompt_file, out_file = work / "prompts8.jsonl", work / "generated8.jsonl"
        prompt_file.write_text("".join(json.dumps(x) + "\n" for x in prompts))
        steps["attnx generate"] = timed([attnx, "generate", args.out, "--prompts", str(prompt_file), "--out",
                                         str(out_file), "--max-new-tokens", str(args.new)])  # fmt: skip
        if steps["attnx generate"]["exit"] == 0:
            lines = [json.loads(x) for x in out_file.read_text().splitlines()]
            steps["attnx generate"]["new_tokens"] = [len(x) for x in lines]
            steps["attnx generate"]["prompt_lengths"] = [len(x) for x in prompts]
        for name in ("attnx verify", "attnx generate"):
            step = steps[name]
            print(f"{name}: exit {step['exit']}, {step['wall_s']} s, peak RSS {step['peak_rss_mb']:.0f} MB; "
                  f"{step['output_tail'][-1] if step['output_tail'] else ''}", flush=True)  # fmt: skip
    package = Path(args.out)
    result = {
        "cpu": throughput.cpu(), "date": datetime.date.today().isoformat(), "attnx_commit": throughput.git_commit(),
        "command": "python measurements/int4_package/build.py " + " ".join(sys.argv[1:]),
        "attnx_threads": os.environ.get("ATTNX_THREADS"), "steps": steps,
        "package_files": {f.name: f.stat().st_size for f in sorted(package.iterdir())} if package.is_dir() else None,
        "package_decode": json.loads((package / "manifest.json").read_text()).get("decode")
        if (package / "manifest.json").exists() else None,
    }  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(s["exit"] == 0 for s in steps.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
