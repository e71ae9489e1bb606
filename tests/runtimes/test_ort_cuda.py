"""ort-cuda: ORT's reason for a failed CUDA start, provider options, the placement check and
IOBinding. Everything but the `cuda`-marked tests runs without a GPU: the binding logic on
a CPU session (IOBinding works the same on "cpu"), the checks on recorded ORT output and
on fake sessions."""

from __future__ import annotations

import json
import os
import types
from typing import ClassVar

import numpy as np
import pytest

from attnx.errors import InputError, ModelFileError, ProviderUnavailable, UsageError
from attnx.model.inputs import make_inputs
from attnx.runtimes import ModelSource, create_runner
from attnx.runtimes import cuda as cuda_mod
from attnx.runtimes.cuda import (
    ASSIGNMENT_INFO_KEY,
    CudaOptions,
    NodePlacement,
    capture_native_stderr,
    ort_build_cuda_reason,
    ort_cuda_failure_reason,
    placement_problems,
    placements_from_assignment_info,
    placements_from_profile,
    provider_option_mismatches,
    set_ort_log_severity,
    unreported_options,
)
from attnx.runtimes.ort_runner import IoBinder, OrtCudaRunner, ort_cuda_unavailable_reason, resolve_shape
from tests.conftest import CONFIGS, weights_for

# What onnxruntime-gpu 1.31.1 wrote to stderr on a machine without CUDA 13 (recorded as is,
# colour codes included), while it silently built a CPU session.
RECORDED_NO_CUDA_LOG = (
    "\x1b[0;93m2026-11-29 14:35:00.578874080 [W:onnxruntime:Default, onnxruntime_pybind_state.cc:856 operator()] "
    "No registered plugin EP device found for 'CUDAExecutionProvider' with device_id=0\x1b[m\n"
    "\x1b[1;31m2026-11-29 14:35:00.583453086 [E:onnxruntime:Default, provider_bridge_ort.cc:2458 operator()] "
    "/onnxruntime_src/onnxruntime/core/session/provider_bridge_ort.cc:2043 onnxruntime::Provider& "
    "onnxruntime::ProviderLibrary::Get() [ONNXRuntimeError] : 1 : FAIL : Failed to load library "
    "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/onnxruntime/capi/libonnxruntime_providers_cuda.so "
    "with error: libcublasLt.so.13: cannot open shared object file: No such file or directory\n\x1b[m\n"
    "\x1b[0;93m2026-11-29 14:35:00.583463862 [W:onnxruntime:Default, onnxruntime_pybind_state.cc:1295 "
    "CreateExecutionProviderFactoryInstance] Failed to create CUDAExecutionProvider. Require cuDNN 9.* and CUDA "
    "13.*. Please install all dependencies as mentioned in the GPU requirements page (https://onnxruntime.ai/docs/"
    "execution-providers/CUDA-ExecutionProvider.html#requirements), make sure they're in the PATH, and that your "
    "GPU is supported.\x1b[m\n"
)

CUDA_OPTIONS_REPORTED = {"device_id": "0", "use_tf32": "0", "enable_cuda_graph": "0", "gpu_mem_limit": "184467"}


@pytest.fixture
def ort_cuda():
    """Skip unless an ort-cuda session really starts here (created and run, never judged
    from get_available_providers()); the skip message is ORT's reason."""
    reason = ort_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def restore_ort_severity():
    yield
    set_ort_log_severity(2)  # ORT's default: what the rest of the test session expects


# ORT's reason ------------------------------------------------------------------------------------
def test_failure_reason_from_recorded_log_is_one_line_with_ort_words():
    reason = ort_cuda_failure_reason(RECORDED_NO_CUDA_LOG)
    assert reason == (
        "cannot load libonnxruntime_providers_cuda.so: libcublasLt.so.13: cannot open shared object file: "
        "No such file or directory; onnxruntime needs cuDNN 9.* and CUDA 13.*"
    )
    assert "\n" not in reason and "\x1b" not in reason


def test_failure_reason_falls_back_to_ort_error_lines_about_cuda():
    log = (
        "2026-11-29 10:00:00.1 [W:onnxruntime:Default, x.cc:1 f] something unrelated\n"
        "2026-11-29 10:00:00.2 [E:onnxruntime:Default, cuda_call.cc:123 CudaCall] CUDA failure 35: CUDA driver "
        "version is insufficient for CUDA runtime version ; GPU=0 ; hostname=h ; expr=cudaSetDevice(info_.device_id);\n"
        "2026-11-29 10:00:00.3 [E:onnxruntime:Default, y.cc:2 g] an error not about the GPU\n"
    )
    reason = ort_cuda_failure_reason(log)
    assert reason is not None and reason.startswith("CUDA failure 35: CUDA driver version is insufficient")
    assert "unrelated" not in reason and "not about the GPU" not in reason
    assert ort_cuda_failure_reason("") is None
    assert ort_cuda_failure_reason("[W:onnxruntime:Default, a.cc:1 f] No registered plugin EP device\n") is None


def test_failure_reason_is_shortened():
    log = "Failed to load library /x/libonnxruntime_providers_cuda.so with error: " + "y" * 1000
    reason = ort_cuda_failure_reason(log)
    assert reason is not None and len(reason) <= 240 and reason.endswith("...")


def test_build_without_cuda_provider_is_named_without_creating_a_session():
    fake = types.SimpleNamespace(__version__="1.30.0", get_available_providers=lambda: ["CPUExecutionProvider"])
    reason = ort_build_cuda_reason(fake)
    assert (
        reason is not None
        and "(onnxruntime 1.30.0) has no CUDAExecutionProvider" in reason
        and "onnxruntime-gpu" in reason
    )
    listed = types.SimpleNamespace(__version__="1.31.1", get_available_providers=lambda: ["CUDAExecutionProvider"])
    assert ort_build_cuda_reason(listed) is None  # listed is not proof: the session check decides


# Capturing fd 2 ---------------------------------------------------------------------------------------
def test_capture_takes_native_stderr_off_the_terminal(capfd):
    with capture_native_stderr() as out:
        os.write(2, b"[E:onnxruntime:Default, a.cc:1 f] from C++\n")  # as ORT's logger writes: to fd 2
    assert out.captured and out.text == "[E:onnxruntime:Default, a.cc:1 f] from C++\n"
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "from C++" not in err and "after" in err


def test_capture_lowers_then_restores_the_recorded_ort_severity(monkeypatch):
    import onnxruntime

    calls: list[int] = []
    monkeypatch.setattr(onnxruntime, "set_default_logger_severity", calls.append)
    monkeypatch.setattr(cuda_mod, "_ort_severity", 2)
    set_ort_log_severity(3)  # what the CLI does
    with capture_native_stderr(ort_severity=2):
        pass
    assert calls == [3, 2, 3]
    assert cuda_mod.ort_log_severity() == 3


def test_capture_restores_fd2_when_the_block_raises(capfd):
    with pytest.raises(RuntimeError), capture_native_stderr():
        raise RuntimeError("boom")
    os.write(2, b"visible again\n")
    assert "visible again" in capfd.readouterr().err


# Options ---------------------------------------------------------------------------------------------
def test_cuda_options_are_set_on_purpose():
    assert CudaOptions().provider_options() == {"device_id": "0", "use_tf32": "0", "enable_cuda_graph": "0"}
    assert CudaOptions(device_id=1, use_tf32=True, cuda_graph=True).provider_options() == {
        "device_id": "1", "use_tf32": "1", "enable_cuda_graph": "1"}  # fmt: skip
    for bad in (-1, True, "0"):
        with pytest.raises(UsageError, match="device id"):
            CudaOptions(device_id=bad)
    for bad in ({"seq": 0}, {"seq": "8"}, {"seq": True}):
        with pytest.raises(UsageError, match="fixed dim 'seq' must be a positive integer"):
            CudaOptions(fixed_dims=bad)


def test_option_mismatches_and_unreported_options():
    asked = CudaOptions().provider_options()
    assert provider_option_mismatches(asked, CUDA_OPTIONS_REPORTED) == []
    assert provider_option_mismatches(asked, {**CUDA_OPTIONS_REPORTED, "use_tf32": "1"}) == [
        "use_tf32: asked 0, session has 1"
    ]
    assert provider_option_mismatches(asked, {"device_id": "0"}) == []
    assert unreported_options(asked, {"device_id": "0"}) == ["use_tf32", "enable_cuda_graph"]
    assert unreported_options(asked, None) == list(asked)


# Placement ------------------------------------------------------------------------------------------
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def test_placement_accepts_shape_ops_on_cpu_and_refuses_compute_there():
    good = [NodePlacement("MatMul", CUDA, "mm0"), NodePlacement("Softmax", CUDA), NodePlacement("Shape", CPU),
            NodePlacement("Concat", CPU), NodePlacement("MemcpyToHost", CUDA)]  # fmt: skip
    assert placement_problems(good) == []
    bad = good + [
        NodePlacement("MatMul", CPU, "mm1"),
        NodePlacement("MultiHeadAttention", CPU, "mha", "com.microsoft"),
        NodePlacement("Attention", CPU, "", ""),
    ]
    assert placement_problems(bad) == [
        "MatMul 'mm1' on CPUExecutionProvider",
        "com.microsoft.MultiHeadAttention 'mha' on CPUExecutionProvider",
        "Attention on CPUExecutionProvider",
    ]


def test_placement_check_that_saw_nothing_is_a_problem():
    assert placement_problems([]) == ["onnxruntime reported no node placements to check"]
    assert placement_problems([NodePlacement("Shape", CPU)]) == [
        "onnxruntime reported no compute node (MatMul, Softmax, attention) to check"
    ]
    # a model of no compute node (the rotary tables a whole model's blocks share, timed apart by attnx optimize): none
    # to place, none missed (seen on an H200: optimize --provider cuda refused its own shared part before)
    assert placement_problems([NodePlacement("Cos", CPU)], holds_compute=False) == []


def _cpu_session(path, record=True, profile_prefix=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if record:
        opts.add_session_config_entry(ASSIGNMENT_INFO_KEY, "1")
    if profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = profile_prefix
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def test_assignment_record_and_profile_agree_on_a_real_model(exported, tmp_path):
    """Both sources of placement, read from a real ORT session of the exported model: they
    name the same compute nodes, all on CPU, which the check refuses for CUDA."""
    path = exported("kpm")
    session = _cpu_session(path, profile_prefix=str(tmp_path / "prof"))
    recorded = placements_from_assignment_info(session.get_provider_graph_assignment_info())
    session.run(None, make_inputs(CONFIGS["kpm"], 1, 3))
    with open(session.end_profiling(), encoding="utf-8") as f:
        profiled = placements_from_profile(json.load(f))
    # The record is taken when ORT partitions the graph, the profile when kernels run (after
    # level-2 fusions, e.g. MatMul+Mul -> FusedMatMul): both show the compute on its EP.
    assert {"MatMul", "Softmax"} <= {p.op_type for p in recorded}
    assert "Softmax" in {p.op_type for p in profiled} and {"MatMul", "FusedMatMul"} & {p.op_type for p in profiled}
    assert {p.provider for p in recorded} == {p.provider for p in profiled} == {CPU}
    assert placement_problems(recorded, CPU) == [] and placement_problems(profiled, CPU) == []
    refused = placement_problems(recorded, CUDA)
    assert refused and all(line.endswith("on CPUExecutionProvider") for line in refused)
    assert len(refused) == sum(p.op_type in cuda_mod.COMPUTE_OPS for p in recorded)


def test_profile_parser_reads_node_events_only():
    events = [
        {"cat": "Session", "name": "model_run", "args": {}},
        {"cat": "Node", "name": "mm_fence_before", "args": {"op_name": "MatMul"}},
        {"cat": "Node", "name": "mm_kernel_time", "args": {"op_name": "MatMul", "provider": CUDA}},
        {"cat": "Node", "name": "mm_kernel_time", "args": {"op_name": "MatMul", "provider": CUDA}},  # 2nd run
        {"cat": "Node", "name": "sm_kernel_time", "args": {"op_name": "Softmax", "provider": CPU}},
    ]
    assert placements_from_profile(events) == [NodePlacement("MatMul", CUDA, "mm"), NodePlacement("Softmax", CPU, "sm")]


# A session that says it started CUDA: a real CPU session underneath, reporting what a CUDA
# session would. It lets the runner's checks and its IOBinding path run end to end here.
class PretendCudaSession:
    def __init__(self, session, reported, providers=(CUDA, CPU), placements=None):
        self._s = session
        self._providers = list(providers)
        self._options = reported
        self._placements = placements

    def __getattr__(self, name):
        return getattr(self._s, name)

    def get_providers(self):
        return self._providers

    def get_provider_options(self):
        return {CUDA: dict(self._options), CPU: {}}

    def get_provider_graph_assignment_info(self):
        if self._placements is not None:
            return self._placements
        real = self._s.get_provider_graph_assignment_info()
        return [types.SimpleNamespace(ep_name=CUDA, get_nodes=sg.get_nodes) for sg in real]


class CpuBoundCudaRunner(OrtCudaRunner):
    """OrtCudaRunner whose session is a PretendCudaSession and whose IOBinding binds on
    "cpu": everything of ort-cuda but the device itself."""

    binding_device = "cpu"
    pretend: ClassVar[dict] = {}

    def create_session(self, path):
        import onnxruntime as ort

        self.ort_log = ""
        opts = self.make_session_options()  # the runner's own: assignment record, fixed dims
        pretend = dict(self.pretend)
        # What a CUDA session reports: the options as asked, unless the test says otherwise.
        reported = pretend.pop("reported", {**CUDA_OPTIONS_REPORTED, **self.options.provider_options()})
        return PretendCudaSession(ort.InferenceSession(path, opts, providers=[CPU]), reported, **pretend)


def _pretend_runner(exported, name="kpm", options=None, **pretend):
    runner = CpuBoundCudaRunner(ModelSource(CONFIGS[name], weights_for(name), exported(name)), options=options)
    runner.pretend = pretend
    return runner


def test_fixed_dims_make_the_session_static_and_refuse_other_sizes(exported):
    options = CudaOptions(cuda_graph=True, fixed_dims={"batch": 1, "seq": 8})
    with _pretend_runner(exported, "self", options=options) as runner:
        assert runner.inputs[0].shape == (1, 8, 32)
        # The shape arithmetic is folded away: nothing ORT would leave on the CPU.
        assert not {"Shape", "Concat", "Gather"} & {p.op_type for p in runner.placements}
        assert runner.binder.static
        feeds = make_inputs(CONFIGS["self"], 1, 8)
        with create_runner("ort-cpu", ModelSource(model_path=exported("self"))) as cpu:
            np.testing.assert_array_equal(runner.run(feeds)["y"], cpu.run(feeds)["y"])
        with pytest.raises(InputError, match="size 9 on axis 1, expected 8"):
            runner.run(make_inputs(CONFIGS["self"], 1, 9))


def test_pretend_cuda_runner_passes_every_check_and_matches_ort_cpu(exported):
    feeds = make_inputs(CONFIGS["kpm"], 2, 5)
    with create_runner("ort-cpu", ModelSource(model_path=exported("kpm"))) as cpu:
        expected = cpu.run(feeds)["y"]
    with _pretend_runner(exported) as runner:
        assert runner.binder is not None and runner.binder.device_type == "cpu"
        assert {p.provider for p in runner.placements} == {CUDA}
        np.testing.assert_array_equal(runner.run(feeds)["y"], expected)
        outs = runner.run_on_device(feeds)
        assert outs.values["y"].device_name() == "cpu"  # an OrtValue: nothing fetched yet
        np.testing.assert_array_equal(outs.numpy()["y"], expected)
        with pytest.raises(InputError, match="missing input 'key_padding_mask'"):
            runner.run_on_device({"x": feeds["x"]})


@pytest.mark.parametrize(
    ("pretend", "message"),
    [
        ({"providers": [CPU]}, "did not start CUDAExecutionProvider"),
        ({"reported": {**CUDA_OPTIONS_REPORTED, "use_tf32": "1"}}, "use_tf32: asked 0, session has 1"),
        ({"reported": {**CUDA_OPTIONS_REPORTED, "device_id": "1"}}, "device_id: asked 0, session has 1"),
        ({"placements": [types.SimpleNamespace(ep_name=CPU, get_nodes=lambda: [
            types.SimpleNamespace(op_type="MatMul", name="node_mm", domain="")])]},
         "placed compute nodes off the GPU for kpm-decomposed-fp32.onnx: MatMul 'node_mm' on CPUExecutionProvider"),
        ({"placements": []}, "no node placements to check"),
    ],
)  # fmt: skip
def test_runner_refuses_a_session_that_is_not_really_on_cuda(exported, pretend, message):
    runner = _pretend_runner(exported, **pretend)
    with pytest.raises(ProviderUnavailable, match=message) as info:
        runner.load()
    assert str(info.value).startswith("backend 'ort-cuda' is unavailable: ") and "\n" not in str(info.value)
    assert not runner.is_loaded


def test_session_creation_errors_are_sorted_into_provider_and_model_failures(exported, monkeypatch, tmp_path):
    import onnxruntime as ort

    def fail_with(text):
        def create(*args, **kwargs):
            raise RuntimeError(text)

        return create

    source = ModelSource(model_path=exported("self"))
    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(ort, "InferenceSession", fail_with("CUDA failure 101: invalid device ordinal"))
    with pytest.raises(ProviderUnavailable, match="could not create a CUDAExecutionProvider session: CUDA failure 101"):
        OrtCudaRunner(source, options=CudaOptions(preload_dlls=False)).load()
    monkeypatch.setattr(ort, "InferenceSession", fail_with("[ONNXRuntimeError] : 10 : INVALID_GRAPH : bad node"))
    with pytest.raises(ModelFileError, match="INVALID_GRAPH"):
        OrtCudaRunner(source, options=CudaOptions(preload_dlls=False)).load()


def test_cpu_only_onnxruntime_is_reported_before_any_session(exported, monkeypatch):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: [CPU])
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: pytest.fail("no session may be created"))
    with pytest.raises(ProviderUnavailable, match="has no CUDAExecutionProvider"):
        create_runner("ort-cuda", ModelSource(model_path=exported("self"))).load()


# On this machine (onnxruntime-gpu, no usable CUDA) -------------------------------------------------------
def test_ort_cuda_here_is_unavailable_with_orts_reason_and_a_quiet_terminal(exported, capfd):
    if ort_cuda_unavailable_reason() is None:
        pytest.skip("CUDA works here: the unavailable path cannot be seen")
    runner = create_runner("ort-cuda", ModelSource(model_path=exported("self")))
    with pytest.raises(ProviderUnavailable) as info:
        runner.load()
    text = str(info.value)
    assert text.startswith("backend 'ort-cuda' is unavailable: onnxruntime did not start CUDAExecutionProvider")
    assert "\n" not in text and "session providers: CPUExecutionProvider" in text
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert "cannot load" in text or "CUDA" in text.split("CUDAExecutionProvider:", 1)[1]
    err = capfd.readouterr().err
    assert "onnxruntime" not in err and "Failed to load library" not in err


# The CLI ---------------------------------------------------------------------------------------------------
def _cli_args(exported, tmp_path, *extra):
    config = tmp_path / "c.json"
    config.write_text(CONFIGS["self"].to_json())
    return ["parity", "--config", str(config), "--seed", "1", "--model", exported("self"), "--batch", "1",
            "--seq", "3", *extra]  # fmt: skip


def test_cli_parity_reports_ort_cuda_skipped_with_the_reason(exported, tmp_path, capfd, restore_ort_severity):
    from attnx.cli import main

    reason = ort_cuda_unavailable_reason()
    if reason is None:
        pytest.skip("CUDA works here: nothing is skipped")
    code = main(_cli_args(exported, tmp_path, "--backends", "ort-cpu,ort-cuda"))
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert f"skipped ort-cuda: {reason}" in out
    assert "[E:onnxruntime" not in err and "[W:onnxruntime" not in err and "Failed to load library" not in err


def test_cli_require_ort_cuda_exits_2_with_one_line(exported, tmp_path, capfd, restore_ort_severity):
    from attnx.cli import main

    reason = ort_cuda_unavailable_reason()
    if reason is None:
        pytest.skip("CUDA works here: --require is satisfied")
    code = main(_cli_args(exported, tmp_path, "--backends", "ort-cpu", "--require", "ort-cuda"))
    err = capfd.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[")]  # not progress lines
    assert lines == [f"attnx parity: error: {reason}"]
    assert "onnxruntime" not in "".join(line for line in err.splitlines() if "error:" not in line)


# IOBinding on a CPU session ------------------------------------------------------------------------------
@pytest.fixture
def cpu_session(exported):
    return _cpu_session(exported("kpm"), record=False)


def _specs(session):
    from attnx.runtimes.ort_runner import ort_tensor_specs

    return ort_tensor_specs(session.get_outputs())


def test_resolve_shape():
    from attnx.model.config import TensorSpec

    spec = TensorSpec("y", "fp32", ("batch", "seq", 32))
    assert resolve_shape(spec, {"batch": 2, "seq": 5}) == (2, 5, 32)
    assert resolve_shape(spec, {"batch": 2}) is None


def test_binder_numpy_inputs_match_session_run_and_fetch_only_when_asked(cpu_session):
    feeds = make_inputs(CONFIGS["kpm"], 2, 4)
    expected = cpu_session.run(None, feeds)[0]
    binder = IoBinder(cpu_session, "cpu")
    binder.bind_inputs(feeds)
    binder.bind_outputs(_specs(cpu_session), {"batch": 2, "seq": 4})
    outs = binder.run(["y"])
    assert outs.values["y"].shape() == [2, 4, 32]
    np.testing.assert_array_equal(outs.numpy()["y"], expected)


def test_binder_binds_torch_tensors_by_pointer_in_and_out(cpu_session):
    torch = pytest.importorskip("torch")
    feeds = make_inputs(CONFIGS["kpm"], 2, 4)
    x = torch.from_numpy(feeds["x"].copy())
    mask = torch.from_numpy(feeds["key_padding_mask"])
    y = torch.empty(2, 4, 32)
    binder = IoBinder(cpu_session, "cpu")
    binder.bind_inputs({"x": x, "key_padding_mask": mask})
    binder.bind_outputs(_specs(cpu_session), {"batch": 2, "seq": 4}, {"y": y})
    x.mul_(2.0)  # after binding: a pointer binding sees it, a copy made at bind time would not
    outs = binder.run(["y"], {"y": y})
    assert outs.values["y"] is y
    expected = cpu_session.run(None, {"x": feeds["x"] * 2.0, "key_padding_mask": feeds["key_padding_mask"]})[0]
    np.testing.assert_array_equal(y.numpy(), expected)


def test_binder_takes_non_contiguous_tensors(cpu_session):
    torch = pytest.importorskip("torch")
    feeds = make_inputs(CONFIGS["kpm"], 2, 4)
    x_t = torch.from_numpy(np.ascontiguousarray(feeds["x"].transpose(1, 0, 2))).transpose(0, 1)
    assert not x_t.is_contiguous()
    binder = IoBinder(cpu_session, "cpu")
    binder.bind_inputs({"x": x_t, "key_padding_mask": torch.from_numpy(feeds["key_padding_mask"])})
    binder.bind_outputs(_specs(cpu_session), {"batch": 2, "seq": 4})
    np.testing.assert_array_equal(binder.run(["y"]).numpy()["y"], cpu_session.run(None, feeds)[0])


def test_binder_refuses_bad_output_buffers(cpu_session):
    torch = pytest.importorskip("torch")
    binder = IoBinder(cpu_session, "cpu")
    specs, dims = _specs(cpu_session), {"batch": 2, "seq": 4}
    with pytest.raises(UsageError, match="has dtype fp16, the model writes fp32"):
        binder.bind_outputs(specs, dims, {"y": torch.empty(2, 4, 32, dtype=torch.float16)})
    with pytest.raises(UsageError, match=r"has shape \[2, 4, 31\], the run writes \[2, 4, 32\]"):
        binder.bind_outputs(specs, dims, {"y": torch.empty(2, 4, 31)})
    with pytest.raises(UsageError, match="must be a torch tensor on cpu:0"):
        binder.bind_outputs(specs, dims, {"y": np.empty((2, 4, 32), np.float32)})
    with pytest.raises(UsageError, match="unknown outputs: z"):
        binder.bind_outputs(specs, dims, {"z": torch.empty(1)})


def test_static_binder_replays_fixed_addresses_and_refuses_new_shapes(cpu_session):
    torch = pytest.importorskip("torch")
    binder = IoBinder(cpu_session, "cpu", static=True)
    specs = _specs(cpu_session)
    first = make_inputs(CONFIGS["kpm"], 2, 4, seed=1)
    binder.bind_inputs(first)
    binder.bind_outputs(specs, {"batch": 2, "seq": 4})
    y1 = binder.run(["y"]).numpy()["y"]
    addresses = {n: b.ort_value.data_ptr() for n, b in binder._static_inputs.items()}
    out_address = binder._static_outputs["y"].data_ptr()
    second = make_inputs(CONFIGS["kpm"], 2, 4, seed=2)
    binder.bind_inputs({"x": torch.from_numpy(second["x"]), "key_padding_mask": second["key_padding_mask"]})
    binder.bind_outputs(specs, {"batch": 2, "seq": 4})
    y2 = binder.run(["y"]).numpy()["y"]
    np.testing.assert_array_equal(y1, cpu_session.run(None, first)[0])
    np.testing.assert_array_equal(y2, cpu_session.run(None, second)[0])
    assert {n: b.ort_value.data_ptr() for n, b in binder._static_inputs.items()} == addresses
    assert binder._static_outputs["y"].data_ptr() == out_address
    with pytest.raises(UsageError, match=r"captured as \[2, 4, 32\], got \[2, 5, 32\]"):
        binder.bind_inputs(make_inputs(CONFIGS["kpm"], 2, 5))
    with pytest.raises(UsageError, match="'x' was captured as fp32, got fp16"):
        binder.bind_inputs({**second, "x": second["x"].astype(np.float16)})
    with pytest.raises(UsageError, match="keeps its own output buffers"):
        binder.bind_outputs(specs, {"batch": 2, "seq": 4}, {"y": torch.empty(2, 4, 32)})


def test_binder_refuses_a_tensor_on_another_device(cpu_session):
    torch = pytest.importorskip("torch")
    binder = IoBinder(cpu_session, "cpu")
    with pytest.raises(InputError, match="input 'x' is on meta, this runner binds on cpu:0"):
        binder.bind_inputs({"x": torch.empty(2, 4, 32, device="meta")})


# On a GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_session_is_on_the_gpu_with_tf32_off(ort_cuda, exported):
    with create_runner("ort-cuda", ModelSource(model_path=exported("kpm"))) as runner:
        assert runner.session.get_providers()[0] == CUDA
        options = runner.session.get_provider_options()[CUDA]
        assert options.get("use_tf32", "0") == "0"
        assert placement_problems(runner.placements) == []
        outs = runner.run_on_device(make_inputs(CONFIGS["kpm"], 2, 4))
        assert outs.values["y"].device_name().lower() == "cuda"


@pytest.mark.cuda
def test_cuda_binding_from_torch_cuda_tensors_is_zero_copy(ort_cuda, exported):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip(f"torch {torch.__version__} cannot reach the GPU: torch CUDA tensors cannot be made")
    feeds = make_inputs(CONFIGS["kpm"], 2, 4)
    with create_runner("ort-cpu", ModelSource(model_path=exported("kpm"))) as cpu:
        expected = cpu.run(feeds)["y"]
    with create_runner("ort-cuda", ModelSource(model_path=exported("kpm"))) as runner:
        x = torch.from_numpy(feeds["x"]).cuda()
        mask = torch.from_numpy(feeds["key_padding_mask"]).cuda()
        y = torch.empty(2, 4, 32, device="cuda")
        outs = runner.run_on_device({"x": x, "key_padding_mask": mask}, out={"y": y})
        assert outs.values["y"] is y and y.data_ptr() == outs.values["y"].data_ptr()
        np.testing.assert_allclose(y.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("lowering", ["decomposed", "ort-fused"])
def test_cuda_graph_replays_new_values_at_a_fixed_shape(ort_cuda, exported, lowering):
    feeds1, feeds2 = (make_inputs(CONFIGS["kpm"], 2, 8, seed=s) for s in (1, 2))
    path = exported("kpm", lowering)
    with create_runner("ort-cpu", ModelSource(model_path=path)) as cpu:
        expected = [cpu.run(f)["y"] for f in (feeds1, feeds2)]
    options = CudaOptions(cuda_graph=True, fixed_dims={"batch": 2, "seq": 8})
    with OrtCudaRunner(ModelSource(model_path=path), options=options) as runner:
        assert runner.session.get_provider_options()[CUDA].get("enable_cuda_graph", "1") == "1"
        for _ in range(3):  # ORT captures after its warm-up runs; every run must be right
            for feeds, want in zip((feeds1, feeds2), expected):
                np.testing.assert_allclose(runner.run(feeds)["y"], want, rtol=1e-4, atol=1e-5)


def test_cuda_graph_refusal_names_the_fix(exported, monkeypatch):
    import onnxruntime as ort

    text = ("This session cannot use the graph capture feature as requested by the user as all compute graph "
            "nodes have not been partitioned to the CUDAExecutionProvider")  # fmt: skip

    def refuse(*args, **kwargs):
        raise RuntimeError(text)

    monkeypatch.setattr(ort, "get_available_providers", lambda: [CUDA, CPU])
    monkeypatch.setattr(ort, "InferenceSession", refuse)
    runner = OrtCudaRunner(ModelSource(model_path=exported("self")), options=CudaOptions(cuda_graph=True))
    with pytest.raises(ProviderUnavailable, match="graph capture feature.*CudaOptions.fixed_dims"):
        runner.load()


def test_cuda_reading_says_whether_a_model_holds_a_compute_node(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from attnx.runtimes.cuda import cuda_reading

    for op, compute in (("Cos", False), ("MatMul", True)):
        inputs = ["x"] if op == "Cos" else ["x", "x"]
        graph = helper.make_graph([helper.make_node(op, inputs, ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])])  # fmt: skip
        path = tmp_path / f"{op}.onnx"
        onnx.save(helper.make_model(graph), path)
        assert cuda_reading(str(path)) == ([], compute)
