"""attnx matrix: one plan of 12 tiny cases (parity on torch and two ONNX lowerings, verify of a
package on cpu and cuda, bench on cpu) run here with the local pool (Ray never imported), then on
a Ray cluster this module starts on the loopback address (a head and a second node tagged
{"tagged": 1}; the plan sends every torch case to the tag and the cuda verify to a GPU no node has),
with one Ray worker killed mid-run; then --resume and Ctrl-C. Verdicts must equal the local run's.
The plan holds each job, backend, lowering and source, two batches and a job's own axes over the plan's, one
sequence length: every case is a process of its own (a torch case imports torch, 3 s), and what these tests check
is the matrix's running and placing of cases, not parity at many shapes (24 cases before, 3 lengths).

The audit job's tests run the builder's tiny Llama (tests/fixtures/genai/llama) and a copy with a window planted
on layer 1, one case per block, on the local pool and once on the same cluster.

Ray is started by the test and stopped by its own process ids (tests/matrix/_cluster.py). When Ray
cannot start on this machine the Ray tests skip, saying why; a wrong result never skips.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from attnx.errors import PackageError, UsageError
from attnx.matrix import BENCH_SLOT, MatrixPlan, load_plan
from attnx.matrix._content import bundle_parts, cache_root, files_bundle, materialize, part_digests
from attnx.matrix._ray import feasible, placement
from attnx.matrix._report import MatrixReport, host_key
from tests.matrix._cluster import RayCluster

# the slow tier: the matrix: case processes, a process pool, a Ray cluster
pytestmark = pytest.mark.slow

PLAN = {
    "presets": ["tiny"],
    "packages": ["pkg"],
    "backends": ["torch", "ort-cpu"],
    "lowerings": ["decomposed", "ort-fused"],
    "batches": [1, 2],
    "seqs": [5],
    "requirements": {"torch": {"tagged": 1}, "ort-cuda": {"GPU": 1}},
    "unschedulable_timeout_s": 3,
    "jobs": {
        "parity": {},
        "verify": {"backends": ["ort-cpu", "ort-cuda"]},
        "bench": {"backends": ["ort-cpu"], "lowerings": ["ort-fused"], "batches": [1], "seqs": [1, 5], "repeat": 3,
                  "warmup": 1, "threads": 1},
    },
}  # fmt: skip
GPU_CASE = "verify:package:pkg:ort-cuda:ort-fused:fp32"
# The CLI in a process of its own, saying at the end whether anything imported ray.
CLI = (
    "import sys; from attnx.cli import main; rc = main(sys.argv[1:]); "
    "print('ray imported' if 'ray' in sys.modules else 'ray not imported', file=sys.stderr); sys.exit(rc)"
)
RAY = shutil.which("ray", path=os.path.dirname(sys.executable))


def attnx(*args: str, cwd: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
    )


def read(out: str) -> dict:
    with open(os.path.join(out, "report.json"), encoding="utf-8") as f:
        return json.load(f)


def by_id(report: dict) -> dict[str, dict]:
    return {c["id"]: c for c in report["cases"]}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A folder with the plan and the package it verifies and times."""
    from attnx.model import preset
    from attnx.workflows import build_package

    root = tmp_path_factory.mktemp("matrix")
    build_package(preset("tiny"), root / "pkg")
    (root / "plan.json").write_text(json.dumps(PLAN))
    return str(root)


@pytest.fixture(scope="module")
def local(work):
    """The plan run here, without --ray: (the finished process, its report)."""
    run = attnx("matrix", "plan.json", "--out", "local", cwd=work)
    return run, read(os.path.join(work, "local"))


@pytest.fixture(scope="module")
def cluster():
    if RAY is None or importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed here (pip install 'attnx[ray]')")
    c = RayCluster(RAY)
    try:
        c.start(num_cpus=1, resources={BENCH_SLOT: 1})
        c.add(num_cpus=1, resources={"tagged": 1, BENCH_SLOT: 1})
        c.nodes = c.wait(2, timeout_s=60)
    except (RuntimeError, OSError) as e:
        c.stop()
        pytest.skip(f"Ray could not start on this machine: {e}")
    yield c
    c.stop()


def test_local_run_reports_every_case_and_never_imports_ray(work, local):
    run, report = local
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ray not imported" in run.stderr
    plan = load_plan(os.path.join(work, "plan.json"))
    assert len(plan.cases()) == 12 and [c["id"] for c in report["cases"]] == [c.id for c in plan.cases()]
    assert report["complete"] and report["passed"] and not report["interrupted"]
    cases = by_id(report)
    # no CUDA here: skipped with onnxruntime's own reason, never run on the CPU instead
    assert cases[GPU_CASE]["status"] == "skipped" and "CUDA" in cases[GPU_CASE]["reason"]
    assert {c["status"] for i, c in cases.items() if i != GPU_CASE} == {"pass"}
    for c in report["cases"]:
        assert c["host"]["hostname"] and c["host"]["node_id"] == "local" and c["host"]["onnxruntime"]
        if c["job"] != "bench" and c["status"] == "pass":  # the comparator's statistics, within its tolerance
            assert 0 <= c["stats"]["needed_atol"] <= c["stats"]["atol"] and c["stats"]["cosine"] > 0.999
    bench = [c for c in report["cases"] if c["job"] == "bench"]
    assert len(bench) == 4 and all(c["bench"]["median_ms"] > 0 for c in bench)
    # a timed case ran alone: no other case's process overlaps it
    for b in bench:
        for c in report["cases"]:
            if c is not b and c.get("span"):
                assert c["span"][1] <= b["span"][0] or c["span"][0] >= b["span"][1], (b["id"], c["id"])
    with open(os.path.join(work, "local", "report.md"), encoding="utf-8") as f:
        md = f.read()
    assert "| case |" in md and "| parity:preset:tiny:torch:-:fp32:b1:s5 | pass, needs atol" in md


def test_local_resume_of_a_finished_report_runs_nothing(work, local):
    before = read(os.path.join(work, "local"))
    run = attnx("matrix", "plan.json", "--out", "local", "--resume", cwd=work)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "0 of 12 cases to run" in run.stderr
    assert by_id(read(os.path.join(work, "local"))) == by_id(before)
    again = attnx("matrix", "plan.json", "--out", "local", cwd=work)  # without --resume: refused, kept
    assert (
        again.returncode == 2
        and "--resume" in again.stderr
        and by_id(read(os.path.join(work, "local"))) == by_id(before)
    )


def _case_processes(sessions: set[int]) -> list[tuple[int, int, str]]:
    """(pid, parent pid, spec path) of the matrix case processes whose parent (a Ray worker) is
    in one of the cluster's sessions (a case process has a session of its own)."""
    out = subprocess.run(
        ["ps", "-ww", "-eo", "pid=,ppid=,sid=,args="], capture_output=True, text=True, check=False
    ).stdout
    rows = [line.split(None, 3) for line in out.splitlines()]
    session = {int(r[0]): int(r[2]) for r in rows if len(r) >= 3}
    return [(int(r[0]), int(r[1]), r[3].split()[-2]) for r in rows
            if len(r) == 4 and "attnx.matrix._worker" in r[3] and session.get(int(r[1])) in sessions]  # fmt: skip


def test_ray_run_places_by_resources_matches_local_and_loses_no_case_to_a_killed_worker(work, local, cluster):
    out = os.path.join(work, "ray")
    os.makedirs(out)
    shutil.copytree(os.path.join(work, "local", "models"), os.path.join(out, "models"))  # the exports, reused
    proc = subprocess.Popen([sys.executable, "-c", CLI, "matrix", "plan.json", "--out", "ray", "--ray", cluster.address],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cluster.env)  # fmt: skip
    killed = None  # (the Ray worker's pid, the case it was running)
    deadline = time.monotonic() + 120
    while killed is None and proc.poll() is None and time.monotonic() < deadline:
        for _pid, parent, spec_path in _case_processes(cluster.sessions()):
            try:
                with open(spec_path, encoding="utf-8") as f:
                    case_id = json.load(f)["id"]
            except (OSError, ValueError):
                continue
            os.kill(parent, signal.SIGKILL)  # the Ray worker running the case, mid-case
            killed = (parent, case_id)
            break
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=240)
    assert killed is not None, "no case process was seen to kill"
    assert proc.returncode == 1, stderr[-3000:]  # 1: the GPU case is unschedulable on this cluster
    assert "ray not imported" not in stderr
    report, local_report = read(out), local[1]
    cases = by_id(report)
    assert list(cases) == [c["id"] for c in local_report["cases"]] and report["complete"]
    # the killed case was retried by Ray and finished, in another worker, with the local verdict
    assert cases[killed[1]]["status"] == by_id(local_report)[killed[1]]["status"]
    assert cases[killed[1]]["worker_pid"] != killed[0]
    assert not [c for c in report["cases"] if c["status"] == "lost"]
    # verdicts equal the local run's; the GPU case is unschedulable, naming the missing resource
    assert {i: c["status"] for i, c in cases.items() if i != GPU_CASE} == {
        c["id"]: c["status"] for c in local_report["cases"] if c["id"] != GPU_CASE
    }
    gpu = cases[GPU_CASE]
    assert gpu["status"] == "unschedulable" and "GPU: 1" in gpu["reason"] and "waited 3 s" in gpu["reason"]
    # every case ran on a node that has what it requires; the tagged ones on the tagged node
    nodes = report["nodes"]
    assert set(nodes) == set(cluster.nodes)
    tagged = {n for n, r in cluster.nodes.items() if r.get("tagged")}
    assert len(tagged) == 1
    ran = [c for c in report["cases"] if c["status"] != "unschedulable"]
    for c in ran:
        need, _ = placement(type("Case", (), {"requires": c["requires"], "timed": c["timed"]})())
        assert feasible(need, {c["host"]["node_id"]: nodes[c["host"]["node_id"]]}), c["id"]
    assert {c["host"]["node_id"] for c in ran if c["requires"].get("tagged")} == tagged
    assert len([c for c in ran if c["requires"].get("tagged")]) == 2
    # at most one timed case per node at a time
    bench = [c for c in ran if c["timed"]]
    for a in bench:
        for b in bench:
            if a is not b and a["host"]["node_id"] == b["host"]["node_id"]:
                assert a["span"][1] <= b["span"][0] or a["span"][0] >= b["span"][1], (a["id"], b["id"])


def test_ray_resume_reruns_nothing_finished(work, cluster):
    src = os.path.join(work, "ray")
    if not os.path.exists(os.path.join(src, "report.json")):
        pytest.skip("needs the Ray run's report (test above)")
    out = os.path.join(work, "ray-resume")
    shutil.copytree(src, out)
    report = read(out)
    dropped = [report["cases"][0]["id"], report["cases"][-1]["id"]]
    report["cases"] = [c for c in report["cases"] if c["id"] not in dropped]
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f)
    before = by_id(report)
    run = attnx(
        "matrix", "plan.json", "--out", "ray-resume", "--ray", cluster.address, "--resume", cwd=work, env=cluster.env
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "3 of 12 cases to run" in run.stderr  # the two dropped and the unschedulable one
    after = by_id(read(out))
    assert list(after) == list(by_id(read(src)))
    for case_id, record in before.items():
        if record["status"] != "unschedulable":
            assert after[case_id] == record, case_id  # kept as it was: not run again
    for case_id in dropped:
        assert after[case_id]["status"] == "pass" and after[case_id]["finished"]


def test_ctrl_c_keeps_every_finished_case_and_resume_completes_it(work, local):
    n = 8  # cases of ~0.3 s each: the interrupt, sent once 2 are in the report, lands before the last
    plan = {"presets": ["tiny"], "backends": ["ort-cpu"], "lowerings": ["decomposed"], "batches": [1],
            "seqs": list(range(1, n + 1)), "jobs": ["parity"]}  # fmt: skip
    with open(os.path.join(work, "small.json"), "w", encoding="utf-8") as f:
        json.dump(plan, f)
    out = os.path.join(work, "interrupted")
    os.makedirs(out)
    shutil.copytree(os.path.join(work, "local", "models"), os.path.join(out, "models"))
    proc = subprocess.Popen([sys.executable, "-c", CLI, "matrix", "small.json", "--out", "interrupted", "--jobs", "1"],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    path = os.path.join(out, "report.json")
    deadline, seen = time.monotonic() + 60, 0
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                seen = len(json.load(f)["cases"])  # valid JSON whenever it is read
            if seen >= 2:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, f"SIGINT sent with {seen} cases in the report: {stderr[-2000:]}"
    report = read(out)
    assert report["interrupted"] and not report["complete"] and 2 <= len(report["cases"]) < n
    assert all(c["status"] == "pass" for c in report["cases"])
    assert not [n for n in os.listdir(out) if ".partial-" in n or n.endswith(".lock")]
    kept = by_id(report)
    run = attnx("matrix", "small.json", "--out", "interrupted", "--resume", cwd=work)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"{n - len(kept)} of {n} cases to run" in run.stderr
    after = by_id(read(out))
    assert len(after) == n and all(after[i] == c for i, c in kept.items())


def test_ray_local_starts_a_cluster_of_its_own_and_leaves_no_token_behind(work, local):
    if RAY is None or importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed here (pip install 'attnx[ray]')")
    plan = {"presets": ["tiny"], "backends": ["ort-cpu"], "lowerings": ["decomposed"], "batches": [1], "seqs": [1, 2],
            "jobs": ["parity"]}  # fmt: skip
    with open(os.path.join(work, "two.json"), "w", encoding="utf-8") as f:
        json.dump(plan, f)
    out = os.path.join(work, "ray-local")
    os.makedirs(out)
    shutil.copytree(os.path.join(work, "local", "models"), os.path.join(out, "models"))
    token = os.path.expanduser("~/.ray/auth_token")
    had_token = os.path.exists(token)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    run = attnx("matrix", "two.json", "--out", "ray-local", "--ray", "local", cwd=work, env=env)
    if run.returncode == 2 and "Ray could not start on this machine" in run.stderr:
        pytest.skip(run.stderr.strip().splitlines()[-1])
    assert run.returncode == 0, run.stderr[-2000:]
    report = read(out)
    assert [c["status"] for c in report["cases"]] == ["pass", "pass"] and report["executor"] == "ray local"
    (node,) = report["nodes"]
    assert {c["host"]["node_id"] for c in report["cases"]} == {node} and report["nodes"][node]["resources"][BENCH_SLOT]
    assert os.path.exists(token) == had_token  # Ray's default would have written one


def test_a_damaged_package_fails_by_name_in_verify_and_is_not_timed(work, tmp_path):
    from attnx.matrix._worker import run_case

    pkg = tmp_path / "pkg"
    shutil.copytree(os.path.join(work, "pkg"), pkg)
    data = bytearray((pkg / "model.onnx").read_bytes())
    data[100] ^= 0xFF
    (pkg / "model.onnx").write_bytes(bytes(data))
    common = {"backend": "ort-cpu", "lowering": "ort-fused", "dtype": "fp32", "seed": 0, "package": str(pkg),
              "config": {"d_model": 64, "n_heads": 4}}  # fmt: skip
    verify = run_case({**common, "job": "verify", "provider": "cpu", "batch": None, "seq": None, "mem_seq": None})
    bench = run_case({**common, "job": "bench", "batch": 1, "seq": 3, "mem_seq": None, "repeat": 2, "warmup": 0,
                      "model_path": str(pkg / "model.onnx")})  # fmt: skip
    for result in (verify, bench):
        assert (
            result["status"] == "fail" and "model.onnx: sha256" in result["reason"] and "(altered)" in result["reason"]
        )
    assert "bench" not in bench


# The plan, the content checks, the resume rule: no processes -------------------------------------
@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"presets": ["tiny"], "jobs": ["parity"], "colour": 1}, "unknown key 'colour'"),
        ({"presets": ["tiny"], "jobs": ["parity"], "backends": ["ort-tpu"]}, "'ort-tpu'"),
        ({"presets": ["huge"], "jobs": ["parity"]}, "unknown preset 'huge'"),
        ({"presets": ["tiny"], "jobs": ["parity"], "seqs": [0]}, "'seqs' must hold positive integers"),
        ({"presets": ["tiny"], "jobs": ["parity"], "requirements": {"torch": {"GPU": -1}}}, "positive number"),
        ({"presets": ["tiny"], "jobs": ["parity"], "requirements": {"torch": {BENCH_SLOT: 1}}}, BENCH_SLOT),
        ({"presets": ["tiny"], "jobs": ["deploy"]}, "unknown job"),
        ({"presets": ["tiny"], "jobs": {"bench": {"repeat": 0}}}, "'repeat' must be an integer of at least 1"),
        ({"presets": ["tiny"], "jobs": ["verify"]}, "the plan has no case"),
        ({"jobs": ["parity"]}, "names no source"),
        ({"presets": ["tiny"], "configs": ["missing.json"], "jobs": ["parity"]}, "missing.json"),
        ({"presets": ["tiny"], "packages": ["."], "jobs": ["verify"]}, "not an attnx package"),
    ],
)
def test_a_bad_plan_is_one_error_naming_what_is_wrong(tmp_path, plan, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(UsageError, match=None) as info:
        load_plan(path)
    assert message in str(info.value)


def test_a_yaml_plan_reads_as_its_json(tmp_path):
    pytest.importorskip("yaml")
    (tmp_path / "p.yaml").write_text("presets: [tiny]\njobs: [parity]\nbackends: [ort-cpu]\nseqs: [4]\nbatches: [1]\n")
    plan = load_plan(tmp_path / "p.yaml")
    assert [c.id for c in plan.cases()] == [
        f"parity:preset:tiny:ort-cpu:{lw}:fp32:b1:s4" for lw in ("decomposed", "onnx", "ort-fused")
    ]


def test_content_is_checked_on_the_node_before_use(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"weights")
    bundle = files_bundle([str(tmp_path / "model.onnx")])
    store = {bundle["files"]["model.onnx"]: b"weights"}
    folder = materialize(bundle, store.__getitem__, str(tmp_path / "cache"))
    with open(os.path.join(folder, "model.onnx"), "rb") as f:
        assert f.read() == b"weights"
    assert materialize(bundle, lambda d: pytest.fail("an intact cached copy is not fetched again"),
                       str(tmp_path / "cache")) == folder  # fmt: skip
    with pytest.raises(PackageError, match="not the"):  # bytes that are not what their hash says
        materialize(bundle, lambda d: b"altered", str(tmp_path / "other"))
    escape = {"key": bundle["key"], "files": {"../outside": bundle["files"]["model.onnx"]}}
    with pytest.raises(PackageError, match="plain files"):  # a name that leaves the folder
        materialize(escape, store.__getitem__, str(tmp_path / "third"))
    assert not os.path.exists(tmp_path / "outside") and not os.listdir(tmp_path / "third")


def test_a_file_travels_in_parts_each_checked_on_the_node(tmp_path):
    """A file larger than a part (a model's data file larger than the driver's memory) is put and written a part
    at a time; each part and the whole file are checked against their hashes."""
    data = b"".join(hashlib.sha256(bytes([i])).digest() for i in range(24)) + b"tail"  # parts of 256, 256, 256, 4
    (tmp_path / "model.onnx.data").write_bytes(data)
    bundle = files_bundle([str(tmp_path / "model.onnx.data")], part_bytes=256)
    parts = list(bundle_parts(bundle, "model.onnx.data", str(tmp_path / "model.onnx.data")))
    assert [len(p) for _, p in parts] == [256, 256, 256, 4] and b"".join(p for _, p in parts) == data
    assert [d for d, _ in parts] == part_digests(bundle) and bundle["files"]["model.onnx.data"] not in part_digests(bundle)
    store = dict(parts)
    fetched = []
    folder = materialize(bundle, lambda d: fetched.append(d) or store[d], str(tmp_path / "cache"))
    assert (tmp_path / "cache" / bundle["key"] / "model.onnx.data").read_bytes() == data and fetched == part_digests(bundle)
    assert folder == str(tmp_path / "cache" / bundle["key"])
    skipped = list(bundle_parts(bundle, "model.onnx.data", str(tmp_path / "model.onnx.data"), skip=store.__contains__))
    assert skipped == []  # what is already put is not read again
    swapped = {**store, parts[1][0]: parts[2][1]}  # a part whose bytes are another's
    with pytest.raises(PackageError, match="'model.onnx.data' part 1 arrived with sha256"):
        materialize(bundle, swapped.__getitem__, str(tmp_path / "other"))
    # parts that each match their hash but are not the file it was sent as
    reordered = {**bundle, "parts": {"model.onnx.data": [parts[1][0], parts[0][0], parts[2][0], parts[3][0]]}}
    with pytest.raises(PackageError, match="'model.onnx.data' arrived with sha256 .* not the"):
        materialize(reordered, store.__getitem__, str(tmp_path / "third"))
    assert not os.listdir(tmp_path / "other") and not os.listdir(tmp_path / "third")


def test_resume_refuses_a_report_of_another_plan(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"presets": ["tiny"], "jobs": ["parity"], "seqs": [1]}))
    (tmp_path / "b.json").write_text(json.dumps({"presets": ["tiny"], "jobs": ["parity"], "seqs": [2]}))
    first = MatrixReport(load_plan(tmp_path / "a.json"), "local", str(tmp_path))
    first.write()
    with pytest.raises(UsageError, match="another plan"):
        MatrixReport(load_plan(tmp_path / "b.json"), "local", str(tmp_path)).resume_from(first.json_path)


def test_placement_asks_ray_for_the_requirement_and_the_bench_slot():
    case = type("Case", (), {"requires": {"GPU": 1.0, "cpu_amx": 1.0}, "timed": True})()
    need, options = placement(case)
    assert need == {"CPU": 1.0, "GPU": 1.0, "cpu_amx": 1.0, BENCH_SLOT: 1.0}
    assert options == {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"cpu_amx": 1.0, BENCH_SLOT: 1.0}}
    nodes = {
        "a": {"resources": {"CPU": 8.0, "GPU": 1.0, BENCH_SLOT: 1.0}},
        "b": {"resources": {"CPU": 2.0, "cpu_amx": 1.0}},
    }
    assert not feasible(need, nodes)  # no one node has it all
    nodes["b"]["resources"].update({"GPU": 1.0, BENCH_SLOT: 1.0})
    assert feasible(need, nodes)


def test_a_case_killed_in_every_attempt_is_reported_lost_with_the_reason(tmp_path, monkeypatch):
    """The local pool's retries: a case whose process is killed each time is lost, never dropped."""
    from attnx.matrix import _run
    from attnx.matrix._worker import CaseKilled

    (tmp_path / "plan.json").write_text(json.dumps({"presets": ["tiny"], "jobs": ["parity"], "backends": ["torch"],
                                                    "seqs": [1], "batches": [1], "retries": 2}))  # fmt: skip
    plan = load_plan(tmp_path / "plan.json")
    calls = []

    def killed(spec, workdir, name, timeout_s, running=None):
        calls.append(name)
        raise CaseKilled("the case process was killed by SIGKILL")

    monkeypatch.setattr(_run, "run_case_process", killed)
    report = _run.run_matrix(plan, tmp_path / "out", _run.LocalExecutor(1))
    (case,) = report.ordered()
    assert len(calls) == 3 and case["status"] == "lost" and case["attempts"] == 3
    assert case["reason"] == "the case process was killed by SIGKILL (3 attempts, 2 retries)"
    assert read(str(tmp_path / "out"))["summary"]["lost"] == 1 and not report.passed


def test_a_task_whose_ray_worker_died_past_its_retries_is_lost_with_the_reason():
    ray = pytest.importorskip("ray")
    from attnx.matrix._ray import _lost_or_failed

    result = _lost_or_failed(ray, ray.exceptions.WorkerCrashedError(), 2)
    assert result["status"] == "lost" and "WorkerCrashedError" in result["reason"] and "2 retries" in result["reason"]


def test_a_ray_address_where_no_cluster_answers_is_refused_before_any_work():
    if importlib.util.find_spec("ray") is None:
        pytest.skip("Ray is not installed here (pip install 'attnx[ray]')")
    from attnx.matrix import RayExecutor
    from tests.matrix._cluster import _free_port

    with pytest.raises(UsageError, match="give local, auto, HOST:PORT"):
        RayExecutor("nonsense")
    with pytest.raises(UsageError, match="no Ray cluster answers there"):
        RayExecutor(f"127.0.0.1:{_free_port()}")


# The audit job: whole models, one case per block --------------------------------------------------------------
GENAI = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "genai")
AUDIT_CASES = [f"audit:model:llama/model.onnx:ort-cpu:layer{i}" for i in (0, 1)]
FAULTY_CASES = [f"audit:model:faulty/model.onnx:ort-cpu:layer{i}" for i in (0, 1)]
WINDOW_FINDING = "layer 1: window 4 in the graph (local_window_size 4), no window in the checkpoint"


def _copy_model(src: str, dst: str, change=None) -> None:
    """The builder's model (tests/fixtures/genai) in a folder of its own; change(proto) plants a fault
    (tests/workflows/test_audit.py's way: the proto changed, its data written beside it)."""
    import onnx

    os.makedirs(dst)
    if change is None:
        for name in ("model.onnx", "model.onnx.data"):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
        return
    proto = onnx.load(os.path.join(src, "model.onnx"))
    change(proto)
    onnx.save(proto, os.path.join(dst, "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)  # fmt: skip


def _window_on_layer_1(proto) -> None:
    node = next(n for n in proto.graph.node if n.op_type == "GroupQueryAttention" and "layers.1/" in n.name)
    next(a for a in node.attribute if a.name == "local_window_size").i = 4  # -1 (no window) as built


@pytest.fixture(scope="module")
def audit_work(tmp_path_factory):
    """The llama fp32 fixture, a copy whose layer 1 has a window its checkpoint does not, the checkpoint, and
    the plans that audit them."""
    root = tmp_path_factory.mktemp("audit")
    _copy_model(os.path.join(GENAI, "llama", "fp32"), str(root / "llama"))
    _copy_model(os.path.join(GENAI, "llama", "fp32"), str(root / "faulty"), _window_on_layer_1)
    shutil.copytree(os.path.join(GENAI, "llama", "checkpoint"), root / "llama-hf")
    for name, models in (("audit", ["llama"]), ("faulty", ["faulty"]), ("both", ["llama", "faulty"])):
        plan = {"models": [{"model": f"{m}/model.onnx", "checkpoint": "llama-hf"} for m in models], "jobs": ["audit"]}
        (root / f"{name}.json").write_text(json.dumps(plan))
    return str(root)


def test_an_audit_plan_runs_each_block_as_a_case_and_a_clean_model_passes(audit_work):
    run = attnx("matrix", "audit.json", "--out", "audit-out", "--jobs", "2", cwd=audit_work)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ray not imported" in run.stderr
    out = os.path.join(audit_work, "audit-out")
    report = read(out)
    assert [c["id"] for c in report["cases"]] == AUDIT_CASES and report["passed"]
    for i, c in enumerate(report["cases"]):
        block = c["audit"]
        assert c["status"] == "pass" and c["layer"] == i and c["reason"] is None
        assert block["index"] == i and block["layer"] == i and block["core"] == "gqa" and not block["findings"]
        assert len(block["checks"]) == 3 and all(k["passed"] for k in block["checks"])  # full, padded, decode
        assert not block["unread"] and not block["skipped"] and block["line"].startswith(f"block {i} = checkpoint layer {i}: pass")
        assert 0 < c["stats"]["needed_atol"] <= c["stats"]["atol"] and c["stats"]["max_abs"] <= c["stats"]["atol"]
        # the files as the plan named them, read where they lie (no copy on the local pool)
        assert block["model"] == os.path.join(audit_work, "llama", "model.onnx")
        assert block["checkpoint"] == os.path.join(audit_work, "llama-hf")
    with open(os.path.join(out, "report.md"), encoding="utf-8") as f:
        md = f.read()
    host = host_key(report["cases"][0]["host"])
    for i, case_id in enumerate(AUDIT_CASES):  # one row per layer, its cell under the host it ran on
        assert f"| {case_id} | pass, needs atol " in md
        assert f"- `{case_id}` on {host}: block {i} = checkpoint layer {i}: pass" in md


def test_a_planted_fault_fails_exactly_its_layer_s_audit_case_with_the_finding(audit_work):
    run = attnx("matrix", "faulty.json", "--out", "faulty-out", "--jobs", "2", cwd=audit_work)
    assert run.returncode == 1, run.stderr[-2000:]
    report = read(os.path.join(audit_work, "faulty-out"))
    cases = by_id(report)
    assert list(cases) == FAULTY_CASES and report["complete"] and not report["passed"]
    ok, bad = cases[FAULTY_CASES[0]], cases[FAULTY_CASES[1]]
    assert ok["status"] == "pass" and not ok["audit"]["findings"]
    assert bad["status"] == "fail" and bad["audit"]["findings"][0] == WINDOW_FINDING
    assert bad["reason"].startswith(WINDOW_FINDING + "; block 1: full sequence (12 tokens) against the reference fails")
    assert "first at position 4" in bad["reason"] and bad["stats"]["max_abs"] > bad["stats"]["atol"]
    assert f"fail {FAULTY_CASES[1]}: {WINDOW_FINDING}" in run.stdout
    with open(os.path.join(audit_work, "faulty-out", "report.md"), encoding="utf-8") as f:
        md = f.read()
    assert f"- `{FAULTY_CASES[1]}` fail: {WINDOW_FINDING}" in md and f"| {FAULTY_CASES[1]} | fail, needs atol" in md


def test_ray_audits_ship_model_data_and_checkpoint_by_content(audit_work, cluster):
    """The clean model and the faulty one on the module's cluster: each case reads the files from its node's
    cache, where they arrived by sha256; the verdicts are the local pool's."""
    run = attnx("matrix", "both.json", "--out", "both-ray", "--ray", cluster.address, cwd=audit_work, env=cluster.env)
    assert run.returncode == 1, run.stderr[-2000:]  # the faulty model's layer 1
    report = read(os.path.join(audit_work, "both-ray"))
    assert [c["id"] for c in report["cases"]] == AUDIT_CASES + FAULTY_CASES and report["complete"]
    assert [c["status"] for c in report["cases"]] == ["pass", "pass", "pass", "fail"]
    assert report["cases"][3]["audit"]["findings"][0] == WINDOW_FINDING
    for c in report["cases"]:
        assert c["host"]["node_id"] in cluster.nodes
        model = c["audit"]["model"]
        name = os.path.basename(os.path.dirname(model))
        local = os.path.join(audit_work, c["source"].split(":", 1)[1])
        assert model.startswith(cache_root()) and name == files_bundle([local, local + ".data"])["key"]
        ckpt = os.path.join(audit_work, "llama-hf")
        ckpt_files = [os.path.join(ckpt, n) for n in ("config.json", "model.safetensors")]
        assert c["audit"]["checkpoint"] == os.path.join(cache_root(), files_bundle(ckpt_files)["key"])
        assert sorted(os.listdir(c["audit"]["checkpoint"])) == ["config.json", "model.safetensors"]


def _plan_of(root, models, **top) -> MatrixPlan:
    (root / "plan.json").write_text(json.dumps({"models": models, "jobs": ["audit"], **top}))
    return load_plan(root / "plan.json")


def test_an_audit_plan_expands_blocks_and_backends(tmp_path):
    model = os.path.join(GENAI, "llama", "fp32", "model.onnx")
    ckpt = os.path.join(GENAI, "llama", "checkpoint")
    plan = _plan_of(tmp_path, [model], backends=["torch", "ort-cpu", "openvino"],
                    requirements={"openvino": {"ov": 1}})  # fmt: skip
    cases = plan.cases()  # every block (counted from the graph), on each backend the audit runs on
    assert [(c.backend, c.layer, c.requires) for c in cases] == [
        ("ort-cpu", 0, {}), ("ort-cpu", 1, {}), ("openvino", 0, {"ov": 1.0}), ("openvino", 1, {"ov": 1.0})
    ]  # fmt: skip
    assert cases[0].id == f"audit:model:{model}:ort-cpu:layer0" and not cases[0].timed
    (source,) = plan.sources
    assert source.files == (model, model + ".data") and source.checkpoint is None
    plan = _plan_of(tmp_path, [{"model": model, "checkpoint": ckpt, "layers": [1]}])
    assert [c.id for c in plan.cases()] == [f"audit:model:{model}:ort-cpu:layer1"]
    assert plan.sources[0].checkpoint_files == (os.path.join(ckpt, "config.json"), os.path.join(ckpt, "model.safetensors"))
    # a plan of parity and audit: the audit's models are not parity's sources, nor the presets the audit's
    (tmp_path / "mixed.json").write_text(json.dumps({"presets": ["tiny"], "models": [model], "backends": ["ort-cpu"],
                                                     "lowerings": ["decomposed"], "batches": [1], "seqs": [2],
                                                     "jobs": ["parity", "audit"]}))  # fmt: skip
    assert [c.id for c in load_plan(tmp_path / "mixed.json").cases()] == [
        "parity:preset:tiny:ort-cpu:decomposed:fp32:b1:s2", f"audit:model:{model}:ort-cpu:layer0",
        f"audit:model:{model}:ort-cpu:layer1",
    ]  # fmt: skip


def test_a_bad_audit_model_is_one_error_naming_it_before_any_work(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    model = os.path.join(GENAI, "llama", "fp32", "model.onnx")
    ckpt = os.path.join(GENAI, "llama", "checkpoint")
    # external data named outside the model's folder
    outside = tmp_path / "outside"
    outside.mkdir()
    proto = onnx.load(model, load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../model.onnx.data"
    onnx.save(proto, str(outside / "model.onnx"))
    shutil.copyfile(model + ".data", tmp_path / "model.onnx.data")
    # a checkpoint whose weights are a link out of its folder
    linked = tmp_path / "linked-hf"
    linked.mkdir()
    shutil.copyfile(os.path.join(ckpt, "config.json"), linked / "config.json")
    os.symlink(os.path.join(ckpt, "model.safetensors"), linked / "model.safetensors")
    # a graph without attention
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])  # fmt: skip
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]),
              str(tmp_path / "relu.onnx"))  # fmt: skip
    bad = [
        ([{"model": model, "layers": [2]}], {}, "'layers' [2]: 2 is not a block of"),
        ([{"model": model, "layers": [0, 0]}], {}, "a block given twice"),
        ([{"model": model, "layers": "some"}], {}, "'layers' must be \"all\" or a non-empty list"),
        ([{"model": model, "colour": 1}], {}, "models[0]: unknown key 'colour'"),
        ([{"checkpoint": ckpt}], {}, "models[0] must be a model's path"),
        (["missing.onnx"], {}, "model 'missing.onnx' does not exist"),
        ([str(outside / "model.onnx")], {}, "'../model.onnx.data'"),
        ([{"model": model, "checkpoint": str(linked)}], {}, "outside the package folder: refused"),
        ([{"model": model, "checkpoint": str(tmp_path)}], {}, "has no config.json"),
        (["relu.onnx"], {}, "'relu.onnx': no attention block found"),
        ([model], {"backends": ["torch"]}, "the audit runs on ort-cpu, openvino, ort-cuda"),
    ]
    for models, top, message in bad:
        with pytest.raises(UsageError) as info:
            _plan_of(tmp_path, models, **top)
        assert message in str(info.value), (models, str(info.value))
