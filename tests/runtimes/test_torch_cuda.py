"""torch-cuda: unavailable with a reason here, never computing on the CPU while it claims the
GPU, numerics (TF32, reduced-precision reductions) set for the run and put back after."""

from __future__ import annotations

import numpy as np
import pytest

from attnx.errors import ProviderUnavailable, UsageError
from attnx.model.inputs import make_inputs
from attnx.runtimes import ModelSource, create_runner, torch_runner
from attnx.runtimes.torch_runner import TorchCudaRunner, torch_cuda_unavailable_reason
from tests.conftest import CONFIGS, weights_for

torch = pytest.importorskip("torch")

FLAGS = {
    "tf32": (torch.backends.cuda.matmul, "allow_tf32"),
    "cudnn_tf32": (torch.backends.cudnn, "allow_tf32"),
    "fp16_reduction": (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    "bf16_reduction": (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
}


def _flags() -> dict[str, bool]:
    return {k: bool(getattr(obj, attr)) for k, (obj, attr) in FLAGS.items()}


@pytest.fixture
def caller_flags():
    """The flags as a caller may have left them (everything on), restored after the test."""
    saved = _flags()
    for obj, attr in FLAGS.values():
        setattr(obj, attr, True)
    yield _flags()
    for key, (obj, attr) in FLAGS.items():
        setattr(obj, attr, saved[key])


@pytest.fixture
def torch_cuda():
    """Skip unless torch really computes on the GPU here (it allocates and multiplies)."""
    reason = torch_cuda_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _source(name="kpm", dtype="fp32"):
    return ModelSource(CONFIGS[name], weights_for(name), None, dtype)


def test_unavailable_here_with_the_reason():
    reason = torch_cuda_unavailable_reason()
    if reason is None:
        pytest.skip("torch reaches a GPU here")
    with pytest.raises(ProviderUnavailable) as info:
        create_runner("torch-cuda", _source()).load()
    assert str(info.value) == f"backend 'torch-cuda' is unavailable: {reason}"
    if torch.version.cuda is None:
        assert reason == f"torch {torch.__version__} is a CPU-only build"


def test_device_id_is_checked():
    with pytest.raises(UsageError, match="device id"):
        TorchCudaRunner(_source(), device_id=-1)
    assert TorchCudaRunner(_source(), device_id=1).device == "cuda:1"


class _LandsOnCpu(TorchCudaRunner):
    """A torch-cuda runner whose module ends up on the CPU (as if a device mapping went
    wrong): the placement check must refuse it."""

    def __init__(self, source, **kwargs):
        super().__init__(source, **kwargs)
        self.device = "cpu"


def test_a_module_on_the_cpu_is_refused_and_flags_are_put_back(monkeypatch, caller_flags):
    monkeypatch.setattr(torch_runner, "torch_cuda_unavailable_reason", lambda device_id=0: None)
    runner = _LandsOnCpu(_source())
    with pytest.raises(ProviderUnavailable, match="the module's tensors are on cpu, not cuda:0"):
        runner.load()
    assert not runner.is_loaded
    assert _flags() == caller_flags


def test_numerics_are_set_for_the_run_and_restored_at_close(monkeypatch, caller_flags):
    monkeypatch.setattr(torch_runner, "torch_cuda_unavailable_reason", lambda device_id=0: None)
    monkeypatch.setattr(_LandsOnCpu, "check_placement", lambda self: None)  # the flags are what is tested
    with _LandsOnCpu(_source()):
        assert _flags() == {"tf32": False, "cudnn_tf32": False, "fp16_reduction": False, "bf16_reduction": False}
    assert _flags() == caller_flags
    with _LandsOnCpu(_source(), allow_tf32=True):  # a benchmark may ask for TF32
        assert _flags() == {"tf32": True, "cudnn_tf32": True, "fp16_reduction": False, "bf16_reduction": False}
    assert _flags() == caller_flags
    for obj, attr in FLAGS.values():  # now a caller with everything off
        setattr(obj, attr, False)
    with _LandsOnCpu(_source(), reduced_precision_reduction=True):  # torch as shipped, for a benchmark
        assert _flags() == {"tf32": False, "cudnn_tf32": False, "fp16_reduction": True, "bf16_reduction": True}
    assert _flags() == dict.fromkeys(FLAGS, False)


def test_run_on_device_keeps_outputs_as_tensors(monkeypatch):
    monkeypatch.setattr(torch_runner, "torch_cuda_unavailable_reason", lambda device_id=0: None)
    monkeypatch.setattr(_LandsOnCpu, "check_placement", lambda self: None)
    feeds = make_inputs(CONFIGS["kpm"], 2, 5)
    with _LandsOnCpu(_source(), core="sdpa") as runner:
        assert runner.module.core == "sdpa"
        y = runner.run_on_device(feeds)["y"]
        assert isinstance(y, torch.Tensor) and y.shape == (2, 5, 32)
        np.testing.assert_array_equal(y.numpy(), runner.run(feeds)["y"])
        with pytest.raises(Exception, match="missing input 'key_padding_mask'"):
            runner.run_on_device({"x": feeds["x"]})


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("attention", ["decomposed", "sdpa"])
def test_cuda_module_matches_the_cpu_module(torch_cuda, dtype, attention):
    from attnx.model.tolerance import problem_size, tolerance_for
    from attnx.runtimes.compare import compare_arrays

    config = CONFIGS["causal_kpm"]
    feeds = make_inputs(config, 3, 33, dtype=dtype)
    with create_runner("reference", _source("causal_kpm", dtype)) as ref:
        want = ref.run(feeds)["y"]
    with TorchCudaRunner(_source("causal_kpm", dtype), core=attention) as runner:
        assert {str(p.device) for p in runner.module.parameters()} == {"cuda:0"}
        y = runner.run_on_device(feeds)["y"]
        assert y.device.type == "cuda" and y.dtype == getattr(torch, {"fp32": "float32", "fp16": "float16"}[dtype])
        got = y.float().cpu().numpy()
    size = problem_size(config, weights_for("causal_kpm"), feeds)
    cmp = compare_arrays("y", got, want, tolerance_for(dtype, "torch-cuda"), size)
    assert cmp, str(cmp)


@pytest.mark.cuda
def test_cuda_feeds_on_another_gpu_are_refused(torch_cuda):
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU: no other device to feed from")
    feeds = make_inputs(CONFIGS["self"], 1, 3)
    with TorchCudaRunner(_source("self"), device_id=0) as runner, pytest.raises(Exception, match="is on cuda:1"):
        runner.run({"x": torch.from_numpy(feeds["x"]).to("cuda:1")})
