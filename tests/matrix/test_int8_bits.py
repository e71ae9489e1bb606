"""A plan's int8 models are written with 7-bit weights whatever the exporting host (issue 39): they run on
every host of the cluster, and a host without VNNI refuses 8-bit ones. Fast: no case process, no Ray."""

from __future__ import annotations

import json
import types

from attnx.matrix._plan import Source
from attnx.matrix._run import MATRIX_INT8_BITS, _export
from attnx.model import preset
from attnx.model.contract import INT8_BITS_KEY, describe


def test_a_plans_int8_model_has_7_bit_weights_on_an_exporter_with_vnni(cpu_host, tmp_path):
    cpu_host(vnni=True)  # where auto would write 8 bits
    source = Source("preset", "preset:tiny", preset("tiny"))
    files = _export(types.SimpleNamespace(seed=0), source, "ort-fused", "int8", str(tmp_path), lambda msg: None)
    assert MATRIX_INT8_BITS == 7 and describe(files[0]).metadata[INT8_BITS_KEY] == "7"
    key = json.loads((tmp_path / "preset_tiny-ort-fused-int8.key.json").read_text())
    assert key["int8_bits"] == 7  # the width is part of the export's reuse key
