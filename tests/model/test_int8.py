"""int8's weight width and the host it is safe on (attnx.model.int8, issue 39): the VNNI check read from
cpuinfo, auto's answer, the width a model records, and the refusal of 8-bit weights on a host without
VNNI. The host is a cpuinfo file the test writes (the cpu_host fixture), never skipped for."""

from __future__ import annotations

import pytest

import attnx.model.int8 as int8
from attnx.errors import ModelFileError, UsageError
from attnx.model.contract import INT8_BITS_KEY


@pytest.mark.parametrize(
    ("flags", "vnni"),
    [("fpu sse avx avx2 fma", False), ("avx2 avx512f avx512_vnni", True), ("avx2 avx_vnni", True),
     ("avx2 amx_tile amx_int8", True), ("avx2 amx_bf16 avx512_bf16", False)],
)  # fmt: skip
def test_vnni_is_read_from_the_cpuinfo_flags(tmp_path, flags, vnni):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: a CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: avx_vnni\n")
    assert int8.has_vnni(str(path)) is vnni  # the first CPU's flags


def test_an_unreadable_cpuinfo_is_a_host_without_vnni(tmp_path):
    """Not Linux (no /proc/cpuinfo), or a file without flags: the safe answer."""
    assert int8.has_vnni(str(tmp_path / "none")) is False
    (tmp_path / "bare").write_text("processor\t: 0\n")
    assert int8.has_vnni(str(tmp_path / "bare")) is False


def test_auto_is_8_bits_with_vnni_and_7_without(cpu_host):
    cpu_host(vnni=True)
    assert int8.int8_weight_bits("int8") == 8 and int8.int8_weight_bits("int8", "7") == 7
    cpu_host(vnni=False)
    assert int8.int8_weight_bits("int8", "auto") == 7 and int8.int8_weight_bits("int8", 8) == 8
    assert int8.int8_weight_bits("int4") is None and int8.int8_weight_bits("fp32", "auto") is None


@pytest.mark.parametrize(("dtype", "bits"), [("fp32", 8), ("int4", "7"), ("fp16", 7)])
def test_a_width_for_another_dtype_is_refused_naming_the_flag(dtype, bits):
    with pytest.raises(UsageError, match=f"--int8-bits {bits} is for --dtype int8 .* not --dtype {dtype}"):
        int8.int8_weight_bits(dtype, bits)


@pytest.mark.parametrize("bits", [6, "9", True, "", None])
def test_a_width_other_than_7_or_8_is_refused(bits):
    with pytest.raises(UsageError, match="--int8-bits .*expected one of auto, 7, 8"):
        int8.int8_weight_bits("int8", bits)


def test_a_model_records_its_width_and_one_without_the_key_has_7():
    assert int8.int8_bits_of({}) == 7  # written before the key: 7-bit weights were the only width
    assert int8.int8_bits_of({INT8_BITS_KEY: "8"}) == 8 and int8.int8_bits_of({INT8_BITS_KEY: "7"}) == 7
    with pytest.raises(ModelFileError, match=f"{INT8_BITS_KEY}.*'16': expected 7 or 8"):
        int8.int8_bits_of({INT8_BITS_KEY: "16"})


def test_8_bit_weights_are_refused_on_a_host_without_vnni(cpu_host):
    cpu_host(vnni=False)
    why = int8.int8_host_refusal({INT8_BITS_KEY: "8"}, "m.onnx")
    assert why is not None and "'m.onnx' holds 8-bit int8 weights" in why
    assert "without VNNI" in why and why.endswith("build the model with --int8-bits 7 (it runs on every CPU)")
    assert int8.int8_host_refusal({INT8_BITS_KEY: "7"}, "m.onnx") is None
    assert int8.int8_host_refusal({}, "m.onnx") is None  # no key: 7 bits, safe everywhere
    cpu_host(vnni=True)
    assert int8.int8_host_refusal({INT8_BITS_KEY: "8"}, "m.onnx") is None
