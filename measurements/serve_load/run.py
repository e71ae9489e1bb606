"""attnx serve under load against transformers serve and llama.cpp's server (llama-cpp-python), one asyncio load
generator for all: C concurrent streaming clients (C = 1, 8, 32, 64), each sending its requests back to back, each
request a prompt of 64-512 tokens (seeded) and 128 new tokens, greedy. Measured per run: new tokens per second (the
new tokens streamed over the run's wall time, first request sent to last stream closed), time to first token and
time between tokens (p50, p99), errors (a status other than 200, a failed connection, a stream that ends with no
finish_reason: each one counted and its first messages kept; a stream that ends with a finish_reason but no
`data: [DONE]`, as transformers serve's do, is counted apart), and how many answers match the reference's greedy tokens.

    .venv/bin/python measurements/serve_load/run.py --work WORK --rounds 1 --json measurements/serve_load/serve_load.json

WORK is make.py's folder, with make_gguf.py's files in WORK/gguf. Each server is started (2 threads each: the
THREADS table), checked on one prompt against the reference, warmed with one request, measured at every client
count, then stopped; the servers take turns within a round (rotated each round), with the 1-minute load average
and `uptime` before and after each server's turn.

The prompts are drawn once (seed 0) and the same for every server: token ids for attnx serve, which takes them; the
same ids as text ("t5 t17 ...") for the others, which their tokenizers map 1:1 (make.py's word-level tokenizer;
make_gguf.py's vocabulary): each server's answer to the check prompt is compared with the reference token by token.
The reference is transformers' greedy generate on the checkpoint (this venv's torch, 16 prompts at once,
left-padded, so a near tie may fall the other way than in a prompt alone); the prompts kept are the first whose reference makes 128 new tokens before any end-of-sequence token, so every answer
that follows the reference is 128 tokens long.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
NEW = 128
CLIENTS = (1, 8, 32, 64)
REQUESTS = {1: 4, 8: 16, 32: 32, 64: 64}  # per run: each client sends REQUESTS[C] / C back to back
POOL = 64
BATCH = 16  # the reference's prompts generated at once, left-padded
THREADS = 2
ATTNX, ATTNX4, TRANSFORMERS, LLAMA, LLAMA4 = ("attnx fp32", "attnx int4", "transformers serve",
                                              "llama.cpp f32", "llama.cpp Q4_0")  # fmt: skip
WHOLE = "attnx fp32 whole prompts"  # --prefill-chunk 0: each prompt prefilled whole as it joins
TOKEN = re.compile(r"t(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(args: argparse.Namespace, port: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each server's command line and the environment it adds: 2 threads each."""
    work = Path(args.work)
    attnx = str(Path(sys.executable).parent / "attnx")
    served = ["--port", str(port), "--max-batch", "64", "--max-queue", "256", "--max-model-len", "1024"]
    llama = [args.llama_python, "-m", "llama_cpp.server", "--host", "127.0.0.1", "--port", str(port), "--n_threads",
             str(THREADS), "--n_threads_batch", str(THREADS), "--n_ctx", "1024", "--n_batch", "512",
             "--interrupt_requests", args.llama_interrupt_requests]  # fmt: skip
    omp = {"OMP_NUM_THREADS": str(THREADS)}
    return {
        ATTNX: ([attnx, "serve", str(work / "pkg-fp32"), *served], {"ATTNX_THREADS": str(THREADS)}),
        ATTNX4: ([attnx, "serve", str(work / "pkg-int4"), *served], {"ATTNX_THREADS": str(THREADS)}),
        WHOLE: ([attnx, "serve", str(work / "pkg-fp32"), *served, "--prefill-chunk", "0"],
                {"ATTNX_THREADS": str(THREADS)}),
        TRANSFORMERS: ([args.transformers, "serve", str(work / "checkpoint"), "--continuous-batching", "--device",
                        "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)],
                       omp | {"HF_HUB_OFFLINE": "1"}),  # fmt: skip
        LLAMA: ([*llama, "--model", str(work / "gguf" / "model-f32.gguf")], omp),
        LLAMA4: ([*llama, "--model", str(work / "gguf" / "model-q4_0.gguf")], omp),
    }


def prompts_and_reference(work: Path) -> tuple[list[list[int]], list[list[int]]]:
    """POOL prompts (lengths 64-512, ids 3-4095, seed 0) whose greedy reference makes NEW tokens, and the
    references; cached in WORK/prompts.json."""
    cache = work / "prompts.json"
    if cache.exists():
        data = json.loads(cache.read_text())
        return data["prompts"], data["reference"]
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(work / "checkpoint", dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts, reference, drawn = [], [], 0
    while len(prompts) < POOL:
        batch = [rng.integers(3, 4096, size=int(rng.integers(64, 513))).tolist() for _ in range(BATCH)]
        drawn += BATCH
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)  # fmt: skip
        for prompt, row in zip(batch, out[:, width:].tolist()):
            if 2 not in row and len(prompts) < POOL:
                prompts.append(prompt)
                reference.append(row)
        print(f"reference: {len(prompts)} prompts of {drawn} drawn", flush=True)
    cache.write_text(json.dumps({"drawn": drawn, "prompts": prompts, "reference": reference}))
    return prompts, reference


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


class Server:
    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log: Path) -> None:
        self.name, self.port, self.base = name, port, f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ | env,
                                     start_new_session=True)  # fmt: skip
        self.model = ""

    async def ready(self, client, timeout: float = 600.0) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}: see {self.log.name}")
            try:
                r = await client.get(f"{self.base}/v1/models", timeout=5)
                if r.status_code == 200:
                    self.model = r.json()["data"][0]["id"]
                    return time.perf_counter() - start
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            await asyncio.sleep(0.5)
        raise SystemExit(f"{self.name} not ready after {timeout} s: see {self.log.name}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group this script started
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def body(self, prompt: list[int], stream: bool) -> dict:
        body = {"model": self.model, "max_tokens": NEW, "temperature": 0, "stream": stream}
        if self.name in (ATTNX, ATTNX4, WHOLE):
            body |= {"prompt": prompt, "return_token_ids": True}
        else:
            body["prompt"] = " ".join(f"t{i}" for i in prompt)
        if self.name in (LLAMA, LLAMA4):
            body["repeat_penalty"] = 1.0  # llama-cpp-python's default is 1.1: greedy is 1.0, as the others'
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def chunk_ids(choice: dict) -> list[int]:
    """The new token ids a chunk carries: its token_ids (attnx), else the ids its text spells ("t5" is 5)."""
    if "token_ids" in choice and choice["token_ids"] is not None:
        return list(choice["token_ids"])
    return [int(m) for m in TOKEN.findall(choice.get("text") or "")]


async def one_request(client, server: Server, prompt: list[int], t0: float) -> dict:
    """One streamed completion: the time of its first token from its sending, the gaps between tokens, its ids."""
    sent = time.perf_counter()
    record = {"sent": sent - t0, "ttft": None, "gaps": [], "ids": [], "error": None, "usage": None, "finish": None}
    last = None
    done = False
    try:
        async with client.stream("POST", f"{server.base}/v1/completions", json=server.body(prompt, True),
                                 timeout=None) as r:  # fmt: skip
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                record["error"] = f"HTTP {r.status_code}: {text[:300]}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    record["usage"] = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    ids = chunk_ids(choice)
                    if choice.get("finish_reason"):
                        record["finish"] = choice["finish_reason"]
                    if not ids:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        record["ttft"] = now - sent
                        rest = len(ids) - 1
                    else:
                        rest = len(ids)
                    if rest:  # a chunk of k tokens: k gaps of its wait / k
                        gap = (now - last) / len(ids) if last is not None else 0.0
                        record["gaps"] += [gap] * rest
                    last = now
                    record["ids"] += ids
        record["done_marker"] = done
        if record["finish"] is None:  # cut short: llama-cpp-python's interrupt_requests ends a stream so
            record["error"] = f"the stream ended with no finish_reason after {len(record['ids'])} tokens" + (
                " (then data: [DONE])" if done else " and no data: [DONE]")
    except Exception as e:  # noqa: BLE001 - every failure is counted and its message kept
        record["error"] = f"{type(e).__name__}: {e}"[:300]
    record["end"] = time.perf_counter() - t0
    return record


async def run_load(client, server: Server, prompts: list[list[int]], reference: list[list[int]], clients: int) -> dict:
    each = REQUESTS[clients] // clients
    t0 = time.perf_counter()

    async def worker(c: int) -> list[dict]:
        out = []
        for k in range(each):
            index = (c * each + k) % len(prompts)
            rec = await one_request(client, server, prompts[index], t0)
            rec["prompt"] = index
            out.append(rec)
        return out

    records = [r for rs in await asyncio.gather(*(worker(c) for c in range(clients))) for r in rs]
    wall = time.perf_counter() - t0
    errors = [r["error"] for r in records if r["error"]]
    new = sum(len(r["ids"]) for r in records)
    ttft = [r["ttft"] for r in records if r["ttft"] is not None]
    gaps = [g for r in records for g in r["gaps"]]
    good = [r for r in records if not r["error"]]
    return {
        "clients": clients, "requests": len(records), "wall_s": round(wall, 3), "new_tokens": new,
        "new_tokens_per_s": round(new / wall, 2), "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tbt_p50_ms": pct([g * 1000 for g in gaps], 50), "tbt_p99_ms": pct([g * 1000 for g in gaps], 99),
        "errors": len(errors), "error_messages": sorted(set(errors))[:5],
        "no_done_marker": sum(not r.get("done_marker") for r in good),
        "short_answers": sum(len(r["ids"]) < NEW for r in good),
        "match_reference": sum(r["ids"] == reference[r["prompt"]] for r in good),
        "usage_mismatch": sum(1 for r in good if r["usage"] and (r["usage"].get("completion_tokens") != len(r["ids"])
                                                                  or r["usage"].get("prompt_tokens") != len(prompts[r["prompt"]]))),
        "per_request": [{"prompt": r["prompt"], "sent_s": round(r["sent"], 3), "ttft_s": r["ttft"] and round(r["ttft"], 4),
                         "new": len(r["ids"]), "finish": r["finish"], "error": r["error"]} for r in records],
    }  # fmt: skip


def load() -> dict:
    text = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "uptime": text}


async def check(client, server: Server, prompt: list[int], reference: list[int]) -> dict:
    """The check prompt whole (not streamed): its ids against the reference's; its usage."""
    r = await client.post(f"{server.base}/v1/completions", json=server.body(prompt, False), timeout=600)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {r.text[:300]}"}
    answer = r.json()
    ids = chunk_ids(answer["choices"][0])
    first_diff = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), None)
    return {"new": len(ids), "match": ids == reference, "first_difference": first_diff,
            "usage": answer.get("usage"), "head": ids[:8], "reference_head": reference[:8]}  # fmt: skip


async def serve_turn(args, name: str, prompts, reference) -> dict:
    import httpx2 as httpx  # the httpx fork this venv's openai client uses

    port = free_port()
    command, env = commands(args, port)[name]
    log = Path(args.work) / "logs" / f"{name.replace(' ', '_')}-{port}.log"
    log.parent.mkdir(exist_ok=True)
    result = {"server": name, "command": " ".join(command), "env": env, "before": load()}
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(command)}", flush=True)
    server = Server(name, command, env, port, log)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    try:
        async with httpx.AsyncClient(limits=limits, timeout=None) as client:
            result["ready_s"] = round(await server.ready(client), 1)
            result["check"] = await check(client, server, prompts[0], reference[0])
            print(f"  ready in {result['ready_s']} s; check: {result['check']}", flush=True)
            await one_request(client, server, prompts[1][:64], time.perf_counter())  # warm-up, not counted
            result["runs"] = []
            for clients in args.clients:
                run = await run_load(client, server, prompts, reference, clients)
                run["after"] = load()
                result["runs"].append(run)
                print(f"  {clients:>2} clients: {run['new_tokens_per_s']:7.1f} tok/s, ttft p50 {run['ttft_p50_s']} "
                      f"p99 {run['ttft_p99_s']} s, tbt p50 {run['tbt_p50_ms']} p99 {run['tbt_p99_ms']} ms, "
                      f"errors {run['errors']}, match {run['match_reference']}/{run['requests']}, "
                      f"wall {run['wall_s']} s, load {run['after']['loadavg_1m']}", flush=True)  # fmt: skip
    finally:
        result["exit"] = server.stop()
        result["after"] = load()
    return result


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Flags")
    info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
    flags = info.get("Flags", "").split()
    return {k: info.get(k) for k in keep[:3]} | {"avx512": any(f.startswith("avx512") for f in flags)}


def versions(args) -> dict:
    def ask(python: str, code: str) -> str:
        return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    tpy = str(Path(args.transformers).parent / "python")
    return {"attnx_commit": commit,
            "onnxruntime": ask(sys.executable, "import onnxruntime; print(onnxruntime.__version__)"),
            "transformers_serve": ask(tpy, "import transformers, torch; print(transformers.__version__, torch.__version__)"),
            "llama_cpp_python": ask(args.llama_python, "import llama_cpp; print(llama_cpp.__version__)")}  # fmt: skip


async def main_async(args) -> int:
    work = Path(args.work)
    prompts, reference = prompts_and_reference(work)
    lengths = [len(p) for p in prompts]
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "versions": versions(args), "threads": THREADS, "new_tokens": NEW, "requests": REQUESTS,
           "prompt_lengths": lengths, "rounds": []}  # fmt: skip
    start = time.perf_counter()
    for r in range(args.rounds):
        order = args.servers[r % len(args.servers):] + args.servers[: r % len(args.servers)]
        turns = []
        for name in order:
            turns.append(await serve_turn(args, name, prompts, reference))
            out["rounds"] = [*out["rounds"][:r], turns]
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    out["wall_s"] = round(time.perf_counter() - start, 1)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json} ({out['wall_s']} s)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/serveload/work")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--servers", nargs="+", default=[ATTNX, TRANSFORMERS, LLAMA, ATTNX4, LLAMA4])
    p.add_argument("--clients", nargs="+", type=int, default=list(CLIENTS))
    p.add_argument("--llama-python", default="/tmp/llama-venv/bin/python")
    p.add_argument("--llama-interrupt-requests", choices=("True", "False"), default="False",
                   help="llama-cpp-python's server setting (its default, True, ends a stream when another request "
                   "waits: the first round's runs)")  # fmt: skip
    p.add_argument("--transformers", default="/tmp/tserve-venv/bin/transformers")
    p.add_argument("--json", default="/tmp/serveload/serve_load.json")
    p.add_argument("--new", type=int, default=NEW, help="new tokens a request (a smoke test's fewer: not the benchmark)")
    args = p.parse_args()
    if args.new != NEW:
        globals()["NEW"] = args.new
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
