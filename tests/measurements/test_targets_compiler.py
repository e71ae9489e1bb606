"""measurements/targets_compiler/targets_compiler.py's verdicts: ratios from one run's measurements, each target able
to fail (the measuring itself is the script's job, run by hand: it takes minutes)."""

from __future__ import annotations

from measurements.targets_compiler.targets_compiler import Measurement, evaluate


def _ms(fused_512: float, torch_best: float, gemm_gflops: float, fused_rss: float, fused_long: float):
    return [
        Measurement("gemm", "512x1024x1024", 512, "ok", median_ms=1.0, gflops=gemm_gflops),
        Measurement("ort-cpu", "ort-fused", 512, "ok", median_ms=fused_512, gflops=400.0),
        Measurement("torch", "decomposed", 512, "ok", median_ms=torch_best * 1.5),
        Measurement("torch", "sdpa", 512, "ok", median_ms=torch_best),
        Measurement("ort-cpu", "decomposed", 8192, "ok", peak_rss_mb=9000.0, first_ms=9000.0, warm_ms=3000.0),
        Measurement("ort-cpu", "ort-fused", 8192, "ok", peak_rss_mb=fused_rss, first_ms=fused_long, warm_ms=fused_long),
    ]


def test_all_targets_met():
    verdicts = evaluate(_ms(fused_512=12.0, torch_best=30.0, gemm_gflops=450.0, fused_rss=400.0, fused_long=900.0))
    assert [v["met"] for v in verdicts] == [True, True, True, True, True]
    assert verdicts[0]["value"] == 30.0 / 12.0  # the better torch forward (sdpa here)
    assert verdicts[1]["value"] == 400.0 / 450.0
    assert verdicts[2]["target"].startswith("seq 8192:")


def test_each_target_can_miss():
    verdicts = evaluate(_ms(fused_512=20.0, torch_best=30.0, gemm_gflops=600.0, fused_rss=1000.0, fused_long=4000.0))
    assert [v["met"] for v in verdicts] == [False, False, False, False, False]


def test_unmeasured_targets_are_not_verdicts():
    ms = [m for m in _ms(12.0, 30.0, 450.0, 400.0, 1000.0) if m.seq == 512]
    ms.append(Measurement("ort-cpu", "decomposed", 8192, "skipped", "needs about 9 GB"))
    verdicts = evaluate(ms)
    assert [v["met"] for v in verdicts] == [True, True, None, None, None]


def test_long_sequence_time_is_judged_cold_and_warm():
    """The first call is where ORT grows its arena; a fused model can beat the decomposed one
    there by far more than once both are warm: each is its own verdict."""
    verdicts = evaluate(_ms(fused_512=12.0, torch_best=30.0, gemm_gflops=450.0, fused_rss=400.0, fused_long=2000.0))
    assert [v["met"] for v in verdicts][3:] == [True, False]
    assert "first call" in verdicts[3]["target"] and "warm" in verdicts[4]["target"]
