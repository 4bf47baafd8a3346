"""bench/gpu/gpu_check.py's CPU mode runs every stage end to end and writes every field of
the report the device run fills (the GPU figures themselves are not checked here)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

STAGE_FIELDS = {
    "exactness": {"note", "process_group", "gpt_tiny", "llama_tiny", "kv_cache_generation"},
    "mfu": {"model", "params", "micro_batch", "seq_len", "dtype", "activation_checkpointing",
            "peak_tflops", "ours", "sdpa_peer", "ours_over_peer"},
    "memory": {"mb4_ckpt1", "mb2_ckpt1", "mb1_ckpt0"},
    "planner": {"calibration_file", "layouts", "predicted_s", "predicted_calibrated_s",
                "measured_s", "ratio", "ratio_calibrated"},
    "pieces": {"weight_caching", "bf16_ckpt", "bf16_no_ckpt", "fp32_ckpt"},
}  # fmt: skip
THROUGHPUT = {"step_s", "loss", "max_allocated", "tokens_per_s", "tflops", "model_tflops",
              "mfu", "mfu_model_flops"}  # fmt: skip
MEMORY_ROW = {"micro_batch", "activation_checkpointing", "estimate", "measured", "ratio"}
EXACT = {"loss_rel", "grad_rel", "tolerance", "grad_tolerance", "ok"}


def test_the_cpu_mode_runs_every_stage_and_writes_every_field(tmp_path):
    """About 15 s of CPU (10 s wall on an idle box, more under load): one child process
    imports torch and the job side once and runs the five stages on a 2-layer GPT; the
    stages are the point, so they are not split into cheaper tests."""
    proc = subprocess.run([sys.executable, str(REPO / "bench/gpu/gpu_check.py"), "--cpu",
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("gpu_check: torch ")  # the versions line comes first
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert {"torch", "cuda", "device", "name"} <= set(report["device"])
    stages = report["stages"]
    assert list(stages) == list(STAGE_FIELDS)
    for name, fields in STAGE_FIELDS.items():
        assert stages[name]["status"] == "ok", stages[name]
        assert fields <= set(stages[name]["results"]), (name, stages[name]["results"])
        assert stages[name]["seconds"] <= stages[name]["budget_s"]
    exact = stages["exactness"]["results"]
    for model in ("gpt_tiny", "llama_tiny"):
        for dtype in ("fp32", "bf16"):
            assert set(exact[model][dtype]) == EXACT and exact[model][dtype]["ok"]
        # --cpu runs bf16 for real (CPU autocast): its gradients differ from fp32's, by
        # bf16's rounding, and the check compares them against its stated bound
        bf16 = exact[model]["bf16"]
        assert 0 < bf16["grad_rel"] <= bf16["grad_tolerance"] == 8 * 2.0**-8, bf16
        assert bf16["grad_rel"] > exact[model]["fp32"]["grad_tolerance"], bf16
    assert exact["kv_cache_generation"]["equal"] and exact["process_group"]["all_reduce_ok"]
    mfu = stages["mfu"]["results"]
    assert set(mfu["ours"]) == set(mfu["sdpa_peer"]) == THROUGHPUT
    assert all(set(row) == MEMORY_ROW for row in stages["memory"]["results"].values())
    planner = stages["planner"]["results"]
    assert planner["measured_s"] == mfu["ours"]["step_s"] and planner["ratio"] > 0
    assert json.loads((tmp_path / "calibration-cpu.json").read_text())["gemm_shapes"]
    assert all(set(stages["pieces"]["results"][k]) == THROUGHPUT
               for k in ("bf16_ckpt", "bf16_no_ckpt", "fp32_ckpt"))  # fmt: skip
    markdown = (tmp_path / "gpu_report.md").read_text()
    assert all(f"## {name}: ok" in markdown for name in STAGE_FIELDS)
