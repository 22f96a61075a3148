"""scripts/gpu-smoke.sh on this machine (no GPU) and against named test doubles of the NVIDIA tools.

No GPU is lent here: the first tests prove the script finds none, says so and still runs the health
checks; the doubles (FAKE_* below: nvidia-smi, dcgmi, nccl-tests' all_reduce_perf printing the
formats those tools print) prove the report carries each figure. The real run on a GPU machine
records its figures in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts/gpu-smoke.sh"

_H100 = "NVIDIA H100 80GB HBM3"
_ROWS = [
    f"0, {_H100}, GPU-aaaa, 00000000:53:00.0, 580.95.05, 81559, Enabled, 31, 70.1, 700.00, 1980, 2619",
    f"1, {_H100}, GPU-bbbb, 00000000:64:00.0, 580.95.05, 81559, Enabled, 30, 69.5, 700.00, 1980, 2619",
]
FAKE_NVIDIA_SMI = f"""#!/bin/sh
# Test double for nvidia-smi: two H100s.
case "$1" in
  -L) echo "GPU 0: {_H100} (UUID: GPU-aaaa)"; echo "GPU 1: {_H100} (UUID: GPU-bbbb)" ;;
  -q) printf 'Driver Version : 580.95.05\\nCUDA Version : 13.0\\n' ;;
  topo) printf '\\tGPU0\\tGPU1\\nGPU0\\t X \\tNV18\\nGPU1\\tNV18\\t X \\n' ;;
  --query-gpu=*) echo "{_ROWS[0]}"; echo "{_ROWS[1]}" ;;
  *) exit 9 ;;
esac
"""
FAKE_DCGMI = """#!/bin/sh
# Test double for dcgmi: diag -r 1 -j passes.
echo '{"DCGM GPU Diagnostic": {"test_categories": []}}'
"""
_NCCL_ROWS = [
    "#  size  count  type  redop  root  time  algbw  busbw  #wrong  time  algbw  busbw  #wrong",
    "  8388608  2097152  float  sum  -1  123.4  67.98  67.98  0  120.1  69.85  69.85  0",
    "  1073741824  268435456  float  sum  -1  6000.0  178.96  178.96  0  5990.0  179.26  179.26  0",
    "# Avg bus bandwidth    : 123.47",
]
# Test double for nccl-tests' all_reduce_perf: its table and summary lines.
FAKE_ALL_REDUCE_PERF = "#!/bin/sh\n" + "".join(f"echo '{row}'\n" for row in _NCCL_ROWS)


def _run(tmp_path: Path, *args: str, path_dirs: list[Path] | None = None, dev: Path | None = None):
    env = {
        "PATH": ":".join([*(str(p) for p in path_dirs or []), "/usr/bin", "/bin"]),
        "GPU_SMOKE_DEV_DIR": str(dev or tmp_path / "no-dev"),
        "TMPDIR": str(tmp_path),
        "HOME": str(tmp_path),
    }
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def test_without_a_gpu_it_says_so_and_still_runs_the_health_checks(tmp_path: Path) -> None:
    proc, report = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "no NVIDIA GPU found" in proc.stderr
    assert report["status"] == "no_gpu" and report["gpu_count"] == 0
    checks = {r["check"]: r for r in report["health"]["results"]}
    # No type given and no IMDS here: nothing is promised, so the GPU checks say so instead of passing.
    assert checks["gpu_count"]["status"] == "skipped"
    assert "no GPU(s) promised" in checks["gpu_count"]["detail"]
    assert checks["path " + str(tmp_path)]["status"] == "pass"
    assert "nccl_allreduce" not in report and "dcgm_diag" not in report
    # Nothing left behind but the report.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smoke.json"]


def test_require_gpu_fails_without_one(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, "--require-gpu")
    assert proc.returncode == 1
    assert report["status"] == "no_gpu"


def test_bad_option_is_a_usage_error(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--frobnicate")
    assert proc.returncode == 2 and "unknown option --frobnicate" in proc.stderr


def test_with_tool_doubles_every_figure_reaches_the_report(tmp_path: Path) -> None:
    bin_dir, dev = tmp_path / "bin", tmp_path / "dev"
    bin_dir.mkdir()
    dev.mkdir()
    (dev / "nvidia0").touch()
    for name, body in (
        ("nvidia-smi", FAKE_NVIDIA_SMI),
        ("dcgmi", FAKE_DCGMI),
        ("all_reduce_perf", FAKE_ALL_REDUCE_PERF),
    ):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    proc, report = _run(tmp_path, "--instance-type", "p5.48xlarge", path_dirs=[bin_dir], dev=dev)
    assert report["status"] == "ran" and report["gpu_count"] == 2
    assert report["gpu_models"] == ["NVIDIA H100 80GB HBM3"]
    assert report["gpus"][1]["persistence_mode"] == "Enabled"
    assert (report["driver_version"], report["cuda_version"]) == ("580.95.05", "13.0")
    assert "NV18" in report["topology"]["matrix"]
    assert report["dcgm_diag"]["passed"] is True
    nccl = report["nccl_allreduce"]
    assert nccl["tool"] == "nccl-tests" and nccl["avg_busbw_gb_s"] == 123.47
    assert nccl["peak_busbw_gb_s"] == 178.96
    # The health checks ran against the doubles: p5.48xlarge expects 8 GPUs, the double shows 2.
    checks = {r["check"]: r for r in report["health"]["results"]}
    assert checks["gpu_count"]["status"] == "fail" and "2 of 8" in checks["gpu_count"]["detail"]
    assert proc.returncode == 1 and "health failed" in proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean() -> None:
    subprocess.run(["shellcheck", str(SCRIPT)], check=True)


def test_script_is_executable() -> None:
    assert os.access(SCRIPT, os.X_OK)
