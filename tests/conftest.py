"""Shared fixtures: one registry of small models and a cache of their exports."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile

import pytest

from attnx.export._export import TRACE_CACHE_ENV, TRACES
from attnx.model import AttentionConfig, init_weights


def pytest_configure(config):
    # A test run started in the background by a non-interactive shell (`cmd &`) inherits SIGINT
    # ignored, and so would every attnx process the tests start (an ignored signal stays ignored
    # across exec, and Python then installs no KeyboardInterrupt handler): the Ctrl-C tests would
    # see the command finish (tests/matrix: rc 0, every case run). They test attnx's own handling,
    # so the run restores Python's.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Under pytest-xdist (.ci/run: one worker per core) every worker shares the machine's cores: each
    # runtime session gets its share (ATTNX_THREADS: ORT's intra-op pool, OpenVINO; OMP_NUM_THREADS:
    # torch), inherited by the attnx processes the tests start. A pool of every core in each worker
    # would spin against the others' (measured slower than one thread each: measurements/facts.md).
    # One folder of traces for the whole run (its workers and the attnx processes they start):
    # torch.onnx's trace dominates an export in a fresh process (measurements/trace_cache) and most
    # tests export the same few configs (docs/about.md, "The tests"). The tests of the exporter itself run without it
    # (the no_trace_cache fixture). Made by the controlling process, removed when it ends.
    if "PYTEST_XDIST_WORKER" not in os.environ and TRACE_CACHE_ENV not in os.environ:
        config._attnx_traces = tempfile.mkdtemp(prefix="attnx-traces-")
        os.environ[TRACE_CACHE_ENV] = config._attnx_traces
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        for name in ("ATTNX_THREADS", "OMP_NUM_THREADS"):
            os.environ.setdefault(name, share)


def pytest_unconfigure(config):
    folder = getattr(config, "_attnx_traces", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(TRACE_CACHE_ENV, None)


# torch.onnx builds its registry of torchlib functions afresh in every export (ONNXRegistry.from_torchlib: onnxscript
# parses the source of each of ~500 functions to read its domain): 0.7 s of CPU a trace after the first in a process,
# 1.4 s the first (measurements/ci_time/README.md). The registry is a function of the installed torch and onnxscript
# and the opset: a worker builds it once per opset, and each export gets its own copy of the table (an export adds to
# it only a custom_translation_table, which attnx never passes). Installed before the first test that runs once torch.onnx's
# exporter is imported (a run that never exports never imports it for this); the attnx processes the tests start
# build their own, as a user's do.
_REGISTRIES: dict[int, object] = {}
_REGISTRATION = "torch.onnx._internal.exporter._registration"
_registry_shared: list[bool] = []


def pytest_runtest_setup(item):
    if not _registry_shared and _REGISTRATION in sys.modules:
        _share_registry(sys.modules[_REGISTRATION])
        _registry_shared.append(True)


def _share_registry(registration) -> None:
    from torch.onnx._internal.exporter import _constants

    build = registration.ONNXRegistry.from_torchlib

    def from_torchlib(cls, opset_version=_constants.TORCHLIB_OPSET):
        if opset_version not in _REGISTRIES:
            _REGISTRIES[opset_version] = build(opset_version)
        built, registry = _REGISTRIES[opset_version], cls()
        registry._opset_version = built._opset_version
        registry.functions = {target: list(decomps) for target, decomps in built.functions.items()}
        return registry

    registration.ONNXRegistry.from_torchlib = classmethod(from_torchlib)


@pytest.fixture
def no_trace_cache(monkeypatch):
    """For the tests of the exporter itself (its output, its callbacks, signals during a trace):
    every export traces, in this process and in the processes the test starts."""
    monkeypatch.delenv(TRACE_CACHE_ENV, raising=False)
    TRACES.clear()


# How the suite is split across pytest-xdist's workers (.ci/run: -n auto --dist loadfile): each test
# file runs whole on one worker (its module fixtures are built once), so what must not run beside
# itself is kept in one file on purpose: the Ray cluster tests (tests/matrix/test_matrix.py), one
# cluster at a time (a head and a node, a dozen processes and their ports). The signal tests run
# beside the others: each run tags its processes and reads the process table for its own tag alone.
# (pytest-xdist's loadgroup would group across files, but sets a test id pytest 9 no longer reads.)
# The files that take longest are handed out first (docs/about.md, "The tests"): one started last would leave
# the other workers idle at the end. The order is the suite's, by the sum of each file's durations
# (measurements/ci_time/README.md, suite_2f3a007.json's runs after the change): the audit files sit in the last
# folder, which collection order handed out last. tests/serve/test_serve_ray.py (20 s) starts a Ray cluster too, and
# is left in collection order, away from the matrix's.
LONGEST_FIRST = ("tests/test_docs.py", "tests/matrix/test_matrix.py", "tests/faults/test_signals.py",
                 "tests/workflows/test_audit_gallery.py", "tests/workflows/test_import.py", "tests/export/test_export.py",
                 "tests/workflows/test_audit.py", "tests/runtimes/test_quant_parity.py",
                 "tests/export/test_llm_lowerings.py", "tests/export/test_decomposed_builders.py", "tests/cli/test_cli.py",
                 "tests/workflows/test_optimize_model.py", "tests/bench/test_bench_sweep.py",
                 "tests/runtimes/test_localise.py", "tests/faults/test_interrupts.py")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # one process: collection order
    first = {path: rank for rank, path in enumerate(LONGEST_FIRST)}
    root = str(config.rootpath)
    # stable: collection order within a rank (xdist keeps it with --no-loadscope-reorder)
    items.sort(key=lambda item: first.get(os.path.relpath(str(item.path), root), len(first)))


# The search for the named scaling a rotary table is (attnx.model.rope_fit.named_rope: linear, llama3, yarn candidates
# against the table) is most of an audit of a model with a scaled rope, and the audit tests read the same fixture
# models again and again (the gallery: every fault of a model with its other layers as they were): 107 searches of 23
# distinct tables in test_audit, test_optimize_model, test_audit_unseen and test_rope_fit. Its answers, per worker.
_NAMED_ROPES: dict[str, object] = {}


@pytest.fixture(scope="module")
def rope_tables_named_once():
    """For a module that audits the same models repeatedly: named_rope, a pure function of the table, its fit and
    the pairs' layout, searched once per distinct input (a digest of the bytes) and its answer reused; a table
    that differs by one bit is another key and is searched afresh."""
    import hashlib

    import numpy as np

    from attnx.model import rope_fit

    search = rope_fit.named_rope

    def once(cos, sin, inv_freq, factor, interleaved):
        digest = hashlib.sha256(repr((float(factor), bool(interleaved))).encode())
        for a in (cos, sin, inv_freq):
            a = np.ascontiguousarray(a)
            digest.update(f"|{a.dtype.str} {a.shape}|".encode() + a.tobytes())
        key = digest.hexdigest()
        if key not in _NAMED_ROPES:
            _NAMED_ROPES[key] = search(cos, sin, inv_freq, factor, interleaved)
        return _NAMED_ROPES[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rope_fit, "named_rope", once)
        yield


# The registry of small models every test draws from: each feature of the contract once.
CONFIGS: dict[str, AttentionConfig] = {
    "self": AttentionConfig(d_model=32, n_heads=4),
    "cross": AttentionConfig(d_model=32, n_heads=4, cross=True, kv_dim=24, v_head_dim=6),
    "causal": AttentionConfig(d_model=32, n_heads=2, causal=True),
    "kpm": AttentionConfig(d_model=32, n_heads=4, key_padding_mask=True),
    "causal_kpm": AttentionConfig(d_model=32, n_heads=4, causal=True, key_padding_mask=True, scale=0.2),
    "cross_kpm": AttentionConfig(
        d_model=32, n_heads=2, head_dim=12, v_head_dim=20, cross=True, kv_dim=40, key_padding_mask=True, bias=False
    ),
}

# Modern LLM attention (issue 22): the registry's layer with every new term at once (rope with
# yarn scaling on part of each head, interleaved pairs; a window; softcap; q/k norms; sinks; grouped
# heads; key padding), and a Llama-3-shaped one (llama3 scaling, no biases).
LLM_CONFIGS: dict[str, AttentionConfig] = {
    "llm": AttentionConfig(
        d_model=48, n_heads=4, n_kv_heads=2, head_dim=12, causal=True, key_padding_mask=True, sliding_window=4,
        softcap=2.0, qk_norm={"eps": 1e-5}, sinks=True,
        rope={"theta": 1000.0, "dim": 8, "interleaved": True,
              "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    ),
    "llama": AttentionConfig(
        d_model=64, n_heads=4, n_kv_heads=2, causal=True, bias=False,
        rope={"theta": 500000.0, "scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    # Llama 4's two kinds of layer (transformers' Llama4TextAttention): chunked with rope on interleaved pairs and the
    # weightless q/k norm after it, and NoPE with the attention temperature; chunks of 3 and a floor_scale of 2 show
    # in a few tokens, and so does the chunks' start under left padding (key_padding_mask)
    "llama4": AttentionConfig(
        d_model=64, n_heads=4, n_kv_heads=2, causal=True, bias=False, key_padding_mask=True, attention_chunk=3,
        qk_l2_norm=1e-5, rope={"theta": 500000.0, "interleaved": True},
    ),
    "llama4-nope": AttentionConfig(
        d_model=64, n_heads=4, n_kv_heads=2, causal=True, bias=False, key_padding_mask=True,
        attn_temperature={"floor_scale": 2.0, "attn_scale": 0.5},
    ),
}  # fmt: skip
# The same terms in the shapes ONNX Runtime's GroupQueryAttention takes (head_dim a multiple of 8;
# the buffer form's rotation a cos/sin width that is a multiple of 8): the onnx and ort-fused
# lowerings (tests/export/test_llm_lowerings.py). "onnx" drops the sinks the standard op lacks.
LLM_FUSED_CONFIGS: dict[str, AttentionConfig] = {
    "ort-fused": dataclasses.replace(LLM_CONFIGS["llm"], head_dim=16, v_head_dim=16),
    "onnx": dataclasses.replace(LLM_CONFIGS["llm"], head_dim=16, v_head_dim=16, sinks=False),
    "buffer": AttentionConfig(
        d_model=64, n_heads=2, n_kv_heads=1, head_dim=32, causal=True, kv_cache=True, sliding_window=4, softcap=2.0,
        qk_norm={"eps": 1e-5}, sinks=True,
        rope={"theta": 1000.0, "dim": 16, "interleaved": True,
              "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    ),
}  # fmt: skip


@pytest.fixture
def cpu_host(monkeypatch, tmp_path):
    """cpu_host(vnni) makes this process see a host with or without VNNI: attnx.model.int8 reads a cpuinfo
    written here (an AVX-512 Xeon's flags, or an AVX2-only EPYC's), as it would /proc/cpuinfo."""
    import attnx.model.int8 as int8

    def host(vnni: bool) -> None:
        flags = "fpu sse avx avx2 fma" + (" avx512f avx512_vnni amx_int8" if vnni else "")
        path = tmp_path / f"cpuinfo-{'vnni' if vnni else 'avx2'}"
        path.write_text(f"processor\t: 0\nmodel name\t: test host\nflags\t\t: {flags}\n\n")
        monkeypatch.setattr(int8, "CPUINFO", str(path))

    return host


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """exported(name, attention="decomposed", dtype="fp32") -> path of a checked export, cached."""
    from attnx.workflows import export_model

    cache: dict[tuple[str, str, str], str] = {}
    root = tmp_path_factory.mktemp("exports")

    def get(name: str, attention: str = "decomposed", dtype: str = "fp32") -> str:
        key = (name, attention, dtype)
        if key not in cache:
            path = os.path.join(root, f"{name}-{attention}-{dtype}.onnx")
            config = CONFIGS[name] if name in CONFIGS else LLM_CONFIGS[name]
            export_model(config, path, init_weights(config, seed=1), seed=1, attention=attention, dtype=dtype)
            cache[key] = path
        return cache[key]

    return get


def weights_for(name: str):
    return init_weights(CONFIGS[name] if name in CONFIGS else LLM_CONFIGS[name], seed=1)
