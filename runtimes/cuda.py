"""What the GPU backends share: ORT CUDA provider options, ORT's own failure reason, and
the check that a session really placed its work on the GPU.

Three facts about onnxruntime-gpu shape this module:

- `get_available_providers()` lists CUDAExecutionProvider whenever onnxruntime-gpu is
  installed, GPU or not. When the provider library cannot start (no driver, CUDA or cuDNN
  missing or of the wrong major version) ORT logs the reason through its C++ logger on the
  process's stderr and silently builds a CPU-only session. So the reason is captured from
  file descriptor 2 around session creation (`capture_native_stderr`), turned into one line
  (`ort_cuda_failure_reason`), and kept off the user's terminal.
- That reason is logged by ORT's *default* logger (the session's log_severity_level does
  not reach it): the error line at severity 3, the "Require cuDNN .. and CUDA .." hint at
  severity 2. `set_ort_log_severity` records what the caller chose, so that the capture can
  lower the severity to warnings for the creation alone and put the caller's back after.
- A session that did start CUDA can still place nodes on CPU (an op or dtype without a CUDA
  kernel). `placement_problems` is a pure function over (op type, provider) pairs; the pairs
  come from ORT's EP graph assignment record (ORT >= 1.23: session config entry
  `session.record_ep_graph_assignment_info`) or, on an older ORT, from a profiling run's
  node events (`placements_from_profile`).

No torch and no onnx at module level: a deployment machine may have only numpy and
onnxruntime (`ort_cuda_unavailable_reason` imports onnx inside, to build its probe model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from attnx.errors import UsageError
from attnx.model.contract import PROVIDERS, op_label

__all__ = [
    "CUDA_PROVIDER",
    "CPU_PROVIDER",
    "COMPUTE_OPS",
    "CudaOptions",
    "NodePlacement",
    "CapturedOutput",
    "capture_native_stderr",
    "set_ort_log_severity",
    "ort_cuda_failure_reason",
    "ort_states_its_requirement",
    "ort_build_cuda_reason",
    "provider_option_mismatches",
    "unreported_options",
    "placement_problems",
    "cuda_kernel_problems",
    "cuda_reading",
    "placements_from_assignment_info",
    "placements_from_profile",
    "ASSIGNMENT_INFO_KEY",
]

logger = logging.getLogger(__name__)

CUDA_PROVIDER = PROVIDERS["cuda"].ort_name
CPU_PROVIDER = PROVIDERS["cpu"].ort_name

# The session config entry that makes ORT record which EP each node was assigned to.
ASSIGNMENT_INFO_KEY = "session.record_ep_graph_assignment_info"

# Ops that hold the model's arithmetic: one of these on CPU means the GPU session does the
# heavy work on the host (and copies activations both ways), which is never what a
# `ort-cuda` run claims to measure. Shape arithmetic (Shape, Gather of shapes, Concat of
# int64 dims, Range) is placed on CPU by ORT on purpose and is not listed.
COMPUTE_OPS: frozenset[str] = frozenset(
    {
        "MatMul",
        "Gemm",
        "FusedMatMul",
        "Einsum",
        "Softmax",
        "Attention",  # ONNX opset 23 and com.microsoft's packed-qkv op share the name
        "MultiHeadAttention",
        "GroupQueryAttention",
        "PackedAttention",
        "PackedMultiHeadAttention",
        "SkipLayerNormalization",
        "LayerNormalization",
    }
)


# Provider options -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CudaOptions:
    """How a GPU backend is set up. Every field is set on purpose, never left to ORT's or
    torch's defaults, because each changes results or timings:

    device_id:  which GPU.
    use_tf32:   TF32 rounds float32 matmul inputs to 10 mantissa bits (float16's), which
                breaks float32 parity: off unless a benchmark asks for it.
    cuda_graph: ORT captures the whole run in a CUDA graph and replays it (less launch
                overhead). Needs fixed shapes and every node on the GPU; the runner then
                keeps its input and output buffers at fixed device addresses.
    fixed_dims: sizes for the model's symbolic dims ({"batch": 1, "seq": 512}), given to ORT
                as free-dimension overrides: shapes become static, ORT folds the shape
                arithmetic away (it would otherwise sit on CPU and make ORT refuse a CUDA
                graph), and feeds of other sizes are refused.
    preload_dlls: let onnxruntime load CUDA and cuDNN from the nvidia-* pip packages
                (onnxruntime.preload_dlls) before the first session, as a torch+CUDA
                environment has them; its messages are captured, not printed.
    """

    device_id: int = 0
    use_tf32: bool = False
    cuda_graph: bool = False
    preload_dlls: bool = True
    fixed_dims: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.device_id, bool) or not isinstance(self.device_id, int) or self.device_id < 0:
            raise UsageError(f"CUDA device id must be a non-negative integer, got {self.device_id!r}")
        for name, size in (self.fixed_dims or {}).items():
            if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise UsageError(f"fixed dim {name!r} must be a positive integer, got {size!r}")

    def provider_options(self) -> dict[str, str]:
        """The CUDAExecutionProvider options, as the strings ORT takes and reports back."""
        return {
            "device_id": str(self.device_id),
            "use_tf32": "1" if self.use_tf32 else "0",
            "enable_cuda_graph": "1" if self.cuda_graph else "0",
        }


def provider_option_mismatches(asked: Mapping[str, str], got: Mapping[str, str] | None) -> list[str]:
    """The options a session reports with another value than asked, e.g.
    ["use_tf32: asked 0, session has 1"]. An option the session does not report is not a
    mismatch: ORT rejects an option it does not know when the session is created, so an
    unreported one was parsed; unreported_options() names those for the debug log."""
    got = got or {}
    return [f"{k}: asked {v}, session has {got[k]}" for k, v in asked.items() if k in got and str(got[k]) != str(v)]


def unreported_options(asked: Mapping[str, str], got: Mapping[str, str] | None) -> list[str]:
    """The asked options a session's get_provider_options() does not list."""
    return [k for k in asked if k not in (got or {})]


# ORT's log: capture and severity ------------------------------------------------------------
_ORT_DEFAULT_SEVERITY = 2  # onnxruntime's own default for its default logger (warnings)
_ort_severity = _ORT_DEFAULT_SEVERITY


def set_ort_log_severity(level: int) -> None:
    """Set ORT's default logger severity (0 verbose .. 4 fatal) and remember it, so that a
    capture that lowers it for one session creation puts this level back afterwards
    (onnxruntime has no getter for it). Without onnxruntime installed (attnx inspect on a
    machine with no runtime) the level is only remembered."""
    global _ort_severity
    _ort_severity = level
    try:
        import onnxruntime
    except ImportError:
        return
    onnxruntime.set_default_logger_severity(level)


def ort_log_severity() -> int:
    """The ORT default logger severity last set through set_ort_log_severity."""
    return _ort_severity


@dataclasses.dataclass
class CapturedOutput:
    """What native code wrote to stderr inside a capture_native_stderr block (filled in when
    the block ends). `captured` is False where fd 2 could not be redirected."""

    text: str = ""
    captured: bool = True


@contextlib.contextmanager
def capture_native_stderr(ort_severity: int | None = None) -> Iterator[CapturedOutput]:
    """Send file descriptor 2 to a temporary file for the block: what C++ (ORT's logger)
    writes there is caught, instead of reaching the terminal. With ort_severity, ORT's
    default logger severity is set to it for the block and put back after.

    fd 2 is process-wide: another thread's stderr output inside the block lands in the
    capture too; it is logged at DEBUG afterwards, not lost."""
    out = CapturedOutput()
    if ort_severity is not None:
        import onnxruntime

        onnxruntime.set_default_logger_severity(ort_severity)
    saved: int | None = None
    tmp = None
    try:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
            tmp = tempfile.TemporaryFile()
            os.dup2(tmp.fileno(), 2)
        except (OSError, ValueError, AttributeError):
            # No usable fd 2 (an embedded interpreter): run the block uncaptured.
            out.captured = False
            if saved is not None:
                os.close(saved)
                saved = None
        yield out
    finally:
        if saved is not None:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        if tmp is not None:
            tmp.seek(0)
            out.text = tmp.read().decode("utf-8", errors="replace")
            tmp.close()
        if ort_severity is not None:
            import onnxruntime

            onnxruntime.set_default_logger_severity(_ort_severity)
        if out.text.strip():
            logger.debug("captured native stderr:\n%s", out.text.rstrip())


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LOAD_FAILURE = re.compile(r"Failed to load library (\S+) with error: (.+)")
_REQUIREMENT = re.compile(r"Require (cuDNN \S+ and CUDA \S+?)\.?(?:\s|$)")
# ORT's log line: "<time> [E:onnxruntime:<logid>, <file>:<line> <function>] <message>"
_LOG_LINE = re.compile(r"\[([VIWEF]):onnxruntime:[^\]]*\]\s*(.*)")
_MAX_PART = 240


def ort_cuda_failure_reason(log_text: str) -> str | None:
    """One line from what ORT logged while it failed to start the CUDA provider, or None
    when the log holds no reason. Known lines first ("Failed to load library X with error:
    Y", "Require cuDNN 9.* and CUDA 13.*"); otherwise ORT's error lines about CUDA."""
    text = _ANSI.sub("", log_text)
    parts: list[str] = []
    for match in _LOAD_FAILURE.finditer(text):
        library, error = match.group(1), match.group(2).strip()
        parts.append(f"cannot load {os.path.basename(library)}: {error}")
    for match in _REQUIREMENT.finditer(text):
        parts.append(f"onnxruntime needs {match.group(1)}")
    if not parts:
        for line in text.splitlines():
            m = _LOG_LINE.search(line)
            if m and m.group(1) in "EF" and ("CUDA" in m.group(2) or "cuda" in m.group(2)):
                parts.append(_strip_ort_prefix(m.group(2)))
    parts = [_shorten(p) for p in dict.fromkeys(parts)]  # dedupe, keep order
    return "; ".join(parts) if parts else None


def ort_states_its_requirement(log_text: str) -> bool:
    """Whether ORT's log names the cuDNN and CUDA it requires ("Require cuDNN 9.* and CUDA 13.*"): then its build's
    CUDA (ort_cuda_build_hint) says nothing more."""
    return _REQUIREMENT.search(_ANSI.sub("", log_text)) is not None


def _strip_ort_prefix(message: str) -> str:
    # "/onnxruntime_src/...cc:2043 onnxruntime::Provider& ...Get() [ONNXRuntimeError] : 1 : FAIL : real text"
    if "[ONNXRuntimeError]" in message:
        message = message.split("[ONNXRuntimeError]", 1)[1]
        message = re.sub(r"^\s*:\s*\d+\s*:\s*[A-Z_]+\s*:\s*", "", message)
    return message.strip()


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_PART else text[: _MAX_PART - 3] + "..."


def ort_build_cuda_reason(ort: Any) -> str | None:
    """Why this onnxruntime build cannot have the CUDA provider at all, else None. This is
    the one use of get_available_providers(): its absence is conclusive, its presence is not."""
    if CUDA_PROVIDER in ort.get_available_providers():
        return None
    info = getattr(getattr(ort, "capi", None), "build_and_package_info", None)
    package = getattr(info, "package_name", "onnxruntime")
    return (
        f"this onnxruntime build ({package} {ort.__version__}) has no {CUDA_PROVIDER} "
        f"(it offers: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu"
    )


def ort_cuda_build_hint(ort: Any) -> str | None:
    """What ORT's build info says of its CUDA, e.g. "onnxruntime-gpu 1.31.1 is built for CUDA 13.0"."""
    info = getattr(getattr(ort, "capi", None), "build_and_package_info", None)
    cuda = getattr(info, "cuda_version", None)
    if cuda:
        return f"{getattr(info, 'package_name', 'onnxruntime')} {ort.__version__} is built for CUDA {cuda}"
    return None


# Placement ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class NodePlacement:
    """One node of the optimized graph and the execution provider ORT assigned it to."""

    op_type: str
    provider: str
    name: str = ""
    domain: str = ""


def placement_problems(
    placements: Iterable[NodePlacement],
    provider: str = CUDA_PROVIDER,
    compute_ops: frozenset[str] = COMPUTE_OPS,
    holds_compute: bool = True,
) -> list[str]:
    """Descriptions of the compute nodes (COMPUTE_OPS) that did not land on `provider`, e.g.
    ["MatMul 'node_3' on CPUExecutionProvider"]. An empty list of placements is a problem
    of its own: a check that saw no nodes has checked nothing; so is a record of no compute node where the model
    holds one (holds_compute; a model of none, the rotary tables a whole model's blocks share, has none to place)."""
    seen = list(placements)
    if not seen:
        return ["onnxruntime reported no node placements to check"]
    if not any(p.op_type in compute_ops for p in seen):
        return ["onnxruntime reported no compute node (MatMul, Softmax, attention) to check"] if holds_compute else []
    problems = []
    for p in seen:
        if p.op_type in compute_ops and p.provider != provider:
            label = op_label(p.domain or "", p.op_type)
            problems.append(f"{label} {p.name!r} on {p.provider}" if p.name else f"{label} on {p.provider}")
    return problems


# MultiHeadAttention's inputs: 8 past_sequence_length, 9 cache_indirection (com.microsoft's schema)
_PAST_SEQUENCE_LENGTH, _CACHE_INDIRECTION = 8, 9


def cuda_kernel_problems(model_path: str) -> list[str]:
    """The nodes of a model that ONNX Runtime's CUDA kernels would run out of bounds, each named: a
    com.microsoft.MultiHeadAttention that writes its cache in place (past_sequence_length) without
    cache_indirection, which its CUDA kernel reads as a growing past and writes past the buffer (measured on an
    H200, onnxruntime-gpu 1.31.1: CUDA error 700, the process aborted; attnx.model.cores.why_not_on_cuda says it
    of the cores attnx writes). Read before the first run: such a run cannot be caught, it ends the process."""
    return cuda_reading(model_path)[0]


def cuda_reading(model_path: str, compute_ops: frozenset[str] = COMPUTE_OPS) -> tuple[list[str], bool]:
    """What an ort-cuda session checks of its model file, read once: (cuda_kernel_problems, whether it holds a
    compute node: placement_problems' holds_compute)."""
    import onnx

    def nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
        for node in graph.node:
            yield node
            for attr in node.attribute:
                for sub in (attr.g,) if attr.HasField("g") else attr.graphs:
                    yield from nodes(sub)

    problems, compute = [], False
    for node in nodes(onnx.load(model_path, load_external_data=False).graph):
        compute = compute or node.op_type in compute_ops
        ins = list(node.input) + [""] * (_CACHE_INDIRECTION + 1 - len(node.input))
        if node.domain == "com.microsoft" and node.op_type == "MultiHeadAttention" \
                and ins[_PAST_SEQUENCE_LENGTH] and not ins[_CACHE_INDIRECTION]:  # fmt: skip
            problems.append(f"{op_label(node.domain, node.op_type)} {node.name!r} writes its cache in place "
                            "(past_sequence_length) without cache_indirection, which its CUDA kernel writes past")
    return problems, compute


def placements_from_assignment_info(subgraphs: Iterable[Any]) -> list[NodePlacement]:
    """NodePlacements from InferenceSession.get_provider_graph_assignment_info() (objects with
    ep_name and get_nodes(), each node with name, op_type, domain)."""
    out = []
    for subgraph in subgraphs:
        for node in subgraph.get_nodes():
            out.append(NodePlacement(node.op_type, subgraph.ep_name, node.name, node.domain))
    return out


def placements_from_profile(events: Sequence[Mapping[str, Any]]) -> list[NodePlacement]:
    """NodePlacements from ORT profile JSON events: each node's kernel event
    (cat "Node", name "<node>_kernel_time") carries args.op_name and args.provider."""
    out: dict[str, NodePlacement] = {}
    for event in events:
        if event.get("cat") != "Node":
            continue
        args = event.get("args") or {}
        name = str(event.get("name", ""))
        if not name.endswith("_kernel_time") or "provider" not in args or "op_name" not in args:
            continue
        node = name[: -len("_kernel_time")]
        out.setdefault(node, NodePlacement(str(args["op_name"]), str(args["provider"]), node))
    return list(out.values())
