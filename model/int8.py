"""int8's weight range, and the host it is safe on (issue 39).

attnx's int8 projections are ONNX Runtime's DynamicQuantizeMatMul: MLAS's u8s8 GEMM. On a CPU
without VNNI (AVX2 only) it multiplies with vpmaddubsw, which adds two u8 x s8 products into a
saturating int16: 255 * 127 * 2 overflows it, 255 * 63 * 2 = 32130 does not (ONNX Runtime's
quantizer calls this reduce_range). 8-bit weights are 15-37% wrong there; 7-bit weights are right
everywhere but double the weights' step (measurements/int8_range: on a VNNI/AMX Xeon, 2.3% against
1.45% relative RMS on a d_model-1024 layer). So the width is a choice, recorded in the model:

- 7 bits ([-63, 63]): runs right on every CPU; the matrix's plans (run across hosts) use it.
- 8 bits ([-127, 127]): for a host with VNNI (AVX-512 VNNI, AVX-VNNI or AMX int8), whose kernels
  add the products in int32; a runner refuses such a model on a host without.
- auto (the default of export, optimize and build): 8 on a host with VNNI, else 7.

The host's answer is read from /proc/cpuinfo's flags (Linux). Where that file cannot be read (another
OS, a sandbox) the host counts as without VNNI: the safe answer (auto writes 7 bits, and an 8-bit
model is refused rather than run wrong). No onnx or onnxruntime here: the deployment side reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from attnx.errors import ModelFileError, UsageError
from attnx.model.contract import INT8_BITS_KEY

__all__ = [
    "CPUINFO",
    "DEFAULT_INT8_BITS",
    "INT8_BITS",
    "INT8_BITS_CHOICES",
    "INT8_BITS_FLAG",
    "INT8_BITS_KEY",
    "INT8_WEIGHT_MAX",
    "VNNI_FLAGS",
    "cpu_flags",
    "has_vnni",
    "int8_bits_of",
    "int8_bits_text",
    "int8_host_refusal",
    "int8_weight_bits",
]

# A model without INT8_BITS_KEY (the contract's metadata key: "7" or "8") was written before issue 39: 7 bits.
DEFAULT_INT8_BITS = 7
INT8_WEIGHT_MAX = {7: 63, 8: 127}  # bits -> the weights' range [-max, max] in int8 storage
INT8_BITS = tuple(INT8_WEIGHT_MAX)
INT8_BITS_CHOICES = ("auto", *map(str, INT8_BITS))  # what --int8-bits takes
INT8_BITS_FLAG = "--int8-bits"

CPUINFO = "/proc/cpuinfo"
# /proc/cpuinfo's flags of an int8 dot product that accumulates in int32 (no int16 step): AVX-512 VNNI,
# AVX-VNNI (the VEX form of Alder Lake and later) and AMX's int8 tiles. MLAS takes its VNNI or AMX
# kernel on such a host.
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.lru_cache(maxsize=8)
def cpu_flags(path: str = CPUINFO) -> frozenset[str]:
    """The first CPU's flags in the cpuinfo file at `path`; empty when it cannot be read or has none
    (not Linux): callers then take the safe answer."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_vnni(path: str | None = None) -> bool:
    """Whether this host's int8 GEMM adds in int32 (a VNNI_FLAGS flag in its cpuinfo; `path`: CPUINFO,
    read at call time so that a test can point it at another host's file). False when unknown."""
    return any(flag in cpu_flags(path or CPUINFO) for flag in VNNI_FLAGS)


def int8_weight_bits(dtype: str, bits: int | str = "auto") -> int | None:
    """The width an int8 model's weights are written in: 7 or 8 as asked, auto 8 on a host with VNNI
    (has_vnni) and 7 elsewhere. None for another dtype, where the width means nothing: there only auto
    is taken (an explicit 7 or 8 is one UsageError naming the flag)."""
    if isinstance(bits, bool) or str(bits) not in INT8_BITS_CHOICES:
        raise UsageError(f"{INT8_BITS_FLAG} {bits!r}: expected one of {', '.join(INT8_BITS_CHOICES)}")
    if dtype != "int8":
        if bits != "auto":
            raise UsageError(f"{INT8_BITS_FLAG} {bits} is for --dtype int8 (the int8 weights' width), not --dtype "
                             f"{dtype}: leave it out")  # fmt: skip
        return None
    if bits == "auto":
        return 8 if has_vnni() else DEFAULT_INT8_BITS
    return int(bits)


def int8_bits_text(bits: int, asked: int | str = "auto") -> str:
    """'8-bit weights (auto: this CPU has VNNI)': what an export's report says of the width it wrote."""
    return f"{bits}-bit weights" + (f" (auto: this CPU {'has' if has_vnni() else 'lacks'} VNNI)" if asked == "auto" else "")


def int8_bits_of(metadata: Mapping[str, str]) -> int:
    """The int8 weights' width a model's metadata records (INT8_BITS_KEY); 7 when it records none (the
    only width before the key). ModelFileError for a value that is no width."""
    text = metadata.get(INT8_BITS_KEY)
    if text is None:
        return DEFAULT_INT8_BITS
    if text.strip() not in map(str, INT8_BITS):
        raise ModelFileError(f"the model's {INT8_BITS_KEY!r} metadata is {text!r}: expected 7 or 8")
    return int(text)


def int8_host_refusal(metadata: Mapping[str, str], source: str) -> str | None:
    """Why the model `source` (its metadata) must not run on this host, or None: 8-bit int8 weights on a
    CPU without VNNI, where ONNX Runtime's u8s8 GEMM saturates and computes them wrong."""
    if int8_bits_of(metadata) <= DEFAULT_INT8_BITS or has_vnni():
        return None
    return (f"{source!r} holds 8-bit int8 weights ({INT8_BITS_KEY} 8), which ONNX Runtime's u8s8 GEMM computes "
            f"wrong on a CPU without VNNI (it saturates an int16: 15-37% off), and this CPU has none of "
            f"{', '.join(VNNI_FLAGS)}: build the model with {INT8_BITS_FLAG} 7 (it runs on every CPU)")  # fmt: skip
