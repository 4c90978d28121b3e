"""scripts/gpu_check.sh's dry run on the CPU: every stage walked, none skipped silently, every outcome summarised.

GPU time comes minutes at a time; a stage that crashes or quietly drops half its work there wastes the one
call.  The dry run (``DRMOO_GPU_CHECK_DRY=1``) runs the same stages at tiny sizes with the device-specific
parts stubbed by CPU equivalents (named in the summary), so such a stage fails here first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The stages, in priority order, that the dry run must run (not skip); then the ones it lists as skipped.
REQUIRED = ("build", "tests", "launches", "tasks_scaling", "tasks_graph", "train_graph", "kernels_device")
LEFT_TO_THE_BUDGET = ("bench", "bench_iter", "cuda_round_trip")


def test_dry_run_walks_every_stage_and_names_the_failing_test(tmp_path: Path) -> None:
    logs = tmp_path / "gpu check logs"  # a space: every path reaches its command as one word
    temporary = tmp_path / "tmp dir"
    temporary.mkdir()
    failing = tmp_path / "test_planted.py"  # the tests stage must name this failure in the summary
    failing.write_text("def test_planted_failure():\n    assert 1 == 2\n")
    environment = {**os.environ, "DRMOO_GPU_CHECK_DRY": "1", "GPU_CHECK_LOGS": str(logs), "TMPDIR": str(temporary),
                   "GPU_CHECK_TESTS": str(failing), "PYTHON": sys.executable,
                   "GPU_CHECK_BUDGET_S": "2400",  # a loaded CPU: the stages' own caps (x4 in a dry run) decide
                   # the planted file needs no plugin: not importing hypothesis and the others saves a second
                   "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    for name in ("OUT", "GPU_CHECK_PREBUILT", "DRMOO_GPU_CHECK_DRY_ALL"):
        environment.pop(name, None)
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=2400)
    output = result.stdout + result.stderr
    summary = (logs / "summary.txt").read_text()
    outcomes = dict(re.findall(r"^stage (\w+): (.*)$", summary, flags=re.MULTILINE))
    assert list(outcomes)[: len(REQUIRED)] == list(REQUIRED), summary
    for stage in REQUIRED:
        expected = "failed (exit 1" if stage == "tests" else "ran (exit 0"
        assert outcomes[stage].startswith(expected), f"{stage}: {outcomes[stage]}\n{output[-4000:]}"
        assert "dry: " in outcomes[stage]  # what the dry run stubbed, named
    for stage in LEFT_TO_THE_BUDGET:
        assert outcomes[stage].startswith("skipped (dry: "), summary
    assert "test failed: " in summary and "test_planted.py::test_planted_failure" in summary
    assert result.returncode == 1  # the planted failure fails the call

    results = logs / "results"
    launches = json.loads((results / "launches-cuda.json").read_text())
    assert {(r["layout"], r["method"]) for r in launches["records"]} >= {("separate", "mgda"), ("shared", "mgda")}
    # --all-cells: no column dropped in any cell (the batch-256 call once lost parameters and TorchJD silently)
    scaling = json.loads((results / "tasks-scaling-gpu.json").read_text())
    wanted = {"plain", "rep-grad", "parameters", "parameters-loop", "parameters-batched", "features",
              "features-double-clip"}
    assert {r["heads"] for r in scaling["records"]} == {"separate", "shared"}
    for record in scaling["records"]:
        assert set(record["median_s"]) >= wanted, record["median_s"].keys()
    graphed = json.loads((results / "tasks-scaling-gpu-graph.json").read_text())
    assert graphed["stand_in"] is True and {r["heads"] for r in graphed["records"]} == {"separate", "shared"}
    for record in graphed["records"]:
        assert set(record["graph_s"]) >= wanted and not set(record["skipped"]) & wanted, record["skipped"]
    timing = json.loads((results / "train-graph.json").read_text())
    assert timing["stand_in"] is True and len(timing["graph_step_s"]) >= 1 and timing["eager_median_s"] > 0

