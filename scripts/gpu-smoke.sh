#!/usr/bin/env bash
# gpu-smoke.sh: a smoke test for any machine with NVIDIA GPUs, run from a gpuforge checkout.
#
# It installs nothing system-wide (everything it writes goes to a temporary directory and the one
# JSON result file) and runs, against whatever it finds:
#   1. roles/health's gpuforge-health checks, with a configuration for this machine;
#   2. an nvidia-smi -q summary (per GPU: model, memory, driver, persistence mode, clocks, power);
#   3. nvidia-smi topo -m;
#   4. DCGM diagnostics level 1 (dcgmi diag -r 1) when DCGM is installed;
#   5. an NCCL all-reduce over all local GPUs: nccl-tests' all_reduce_perf when it is on PATH (or in
#      NCCL_TESTS_DIR), else PyTorch (torch.distributed, NCCL backend) when python3 can import a
#      CUDA build of torch.
# and writes every figure into one JSON file. Without an NVIDIA GPU it says so, writes a JSON file
# that says so, and exits 0 (or 1 with --require-gpu).
#
# Usage: scripts/gpu-smoke.sh [--out FILE] [--instance-type TYPE] [--require-gpu]
#                             [--max-bytes N] [--timeout SECONDS]
set -euo pipefail

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
}

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=""
instance_type=""
require_gpu=0
max_bytes=$((1 << 30))
step_timeout=600
# Where device nodes are looked for; the unit tests point this at a test double.
dev_dir="${GPU_SMOKE_DEV_DIR:-/dev}"

while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:?--out needs a file}"; shift 2 ;;
    --instance-type) instance_type="${2:?--instance-type needs a type}"; shift 2 ;;
    --require-gpu) require_gpu=1; shift ;;
    --max-bytes) max_bytes="${2:?--max-bytes needs a number}"; shift 2 ;;
    --timeout) step_timeout="${2:?--timeout needs seconds}"; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu-smoke: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$max_bytes$step_timeout" in
  *[!0-9]*) echo "gpu-smoke: --max-bytes and --timeout take whole numbers" >&2; exit 2 ;;
esac

if ! command -v python3 >/dev/null; then
  echo "gpu-smoke: python3 is needed (the health checks and the JSON report are Python)" >&2
  exit 2
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-smoke.XXXXXX")"
trap 'rm -rf "$work"' EXIT
host="$(hostname -s 2>/dev/null || hostname)"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
out="${out:-$PWD/gpu-smoke-$host-$stamp.json}"

log() { echo "gpu-smoke: $*" >&2; }

# run_step NAME CMD...: run with a time limit, keep stdout/stderr/rc under $work/NAME.*
run_step() {
  local name="$1" rc=0
  shift
  timeout "$step_timeout" "$@" >"$work/$name.out" 2>"$work/$name.err" || rc=$?
  echo "$rc" >"$work/$name.rc"
  return 0
}

# The instance type: given, else IMDSv2 (EC2 only, short timeouts), else unknown.
if [ -z "$instance_type" ] && [ -r /sys/class/dmi/id/board_vendor ] \
  && [ "$(cat /sys/class/dmi/id/board_vendor)" = "Amazon EC2" ] && command -v curl >/dev/null; then
  token="$(curl -s -m 2 -X PUT -H 'X-aws-ec2-metadata-token-ttl-seconds: 60' \
    http://169.254.169.254/latest/api/token || true)"
  if [ -n "$token" ]; then
    instance_type="$(curl -s -m 2 -H "X-aws-ec2-metadata-token: $token" \
      http://169.254.169.254/latest/meta-data/instance-type || true)"
  fi
  unset token
fi

# GPUs: nvidia-smi must answer and list them; a device node alone is not a working GPU.
gpu_count=0
if command -v nvidia-smi >/dev/null && compgen -G "$dev_dir/nvidia[0-9]*" >/dev/null; then
  run_step smi_list nvidia-smi -L
  if [ "$(cat "$work/smi_list.rc")" = 0 ]; then
    gpu_count="$(grep -c '^GPU [0-9]' "$work/smi_list.out" || true)"
  fi
fi
efa_count=0
for dev in /sys/class/infiniband/*; do
  if [ -e "$dev/device/driver" ] && [ "$(basename "$(readlink -f "$dev/device/driver")")" = efa ]; then
    efa_count=$((efa_count + 1))
  fi
done

if [ "$gpu_count" -gt 0 ]; then
  log "$gpu_count NVIDIA GPU(s) found${instance_type:+ on $instance_type}"
  run_step smi_query nvidia-smi \
    --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total,persistence_mode,temperature.gpu,power.draw,power.limit,clocks.max.sm,clocks.max.memory \
    --format=csv,noheader,nounits
  run_step smi_q nvidia-smi -q
  run_step topo nvidia-smi topo -m
  if command -v dcgmi >/dev/null; then
    log "DCGM diagnostics level 1"
    run_step dcgm dcgmi diag -r 1 -j
  fi
  all_reduce="$(command -v all_reduce_perf || true)"
  if [ -z "$all_reduce" ] && [ -n "${NCCL_TESTS_DIR:-}" ] && [ -x "$NCCL_TESTS_DIR/all_reduce_perf" ]; then
    all_reduce="$NCCL_TESTS_DIR/all_reduce_perf"
  fi
  if [ -n "$all_reduce" ]; then
    log "NCCL all-reduce over $gpu_count GPU(s) with nccl-tests ($all_reduce)"
    echo nccl-tests >"$work/nccl.tool"
    run_step nccl "$all_reduce" -b 8 -e "$max_bytes" -f 2 -g "$gpu_count" -c 1 -n 20 -w 5
  elif python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    log "NCCL all-reduce over $gpu_count GPU(s) with PyTorch"
    echo pytorch >"$work/nccl.tool"
    cat >"$work/allreduce.py" <<'PY'
"""All-reduce bus bandwidth over every local GPU, one process per GPU (torch.distributed, NCCL)."""
import json, os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port, max_bytes, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    rows, size = [], 8 << 20
    while size <= max_bytes:
        x = torch.ones(size // 4, dtype=torch.float32, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dist.barrier()
        iters, start = 20, time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        algbw = size / seconds / 1e9
        # nccl-tests' definition: busbw = algbw * 2 (n - 1) / n for all-reduce.
        rows.append({"bytes": size, "time_us": seconds * 1e6, "algbw_gb_s": algbw,
                     "busbw_gb_s": algbw * 2 * (world - 1) / world})
        x.fill_(1.0)
        dist.all_reduce(x)
        rows[-1]["correct"] = bool(torch.all(x == float(world)).item())
        size *= 4
    if rank == 0:
        queue.put({"nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
                   "torch_version": torch.__version__, "sizes": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    world, port, max_bytes = torch.cuda.device_count(), int(sys.argv[1]), int(sys.argv[2])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(worker, args=(world, port, max_bytes, queue), nprocs=world, join=True)
    print(json.dumps(queue.get()))
PY
    port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    run_step nccl python3 "$work/allreduce.py" "$port" "$max_bytes"
  else
    log "no nccl-tests and no CUDA build of PyTorch for python3: NCCL all-reduce not run"
  fi
else
  log "no NVIDIA GPU found (nvidia-smi missing, no $dev_dir/nvidia* device, or nvidia-smi lists none):" \
    "GPU checks not run"
fi

# The health checks of roles/health, configured for what was found here.
GPU_COUNT="$gpu_count" EFA_COUNT="$efa_count" INSTANCE_TYPE="$instance_type" python3 - "$repo" "$work" <<'PY'
import json, os, sys
from pathlib import Path

repo, work = Path(sys.argv[1]), Path(sys.argv[2])
itype = os.environ["INSTANCE_TYPE"]
types = {}
try:
    import yaml  # optional: the expected hardware per type comes from data/instance_types.yml

    types = yaml.safe_load((repo / "data/instance_types.yml").read_text())["gpuforge_instance_types"]
except ImportError:
    pass
# The same keys roles/health writes (templates/etc/gpuforge/health.json.j2); the script detects the
# hardware itself and compares it with the instance type's row.
config = {
    "instance_type": itype or "unknown",
    "instance_types": types,
    # The instance type was looked up above (or given); the health script need not ask IMDS again.
    "imds": False,
    "hardware_absent_by_design": False,
    "max_temperature_c": 85,
    "timeout_s": 30,
    "dcgm_timeout_s": 1800,
    # DCGM runs separately below with its own figures.
    "dcgm_level": {"adhoc": 0, "prolog": 0, "epilog": 0},
    "paths": [{"path": os.environ.get("TMPDIR", "/tmp"), "min_free_gib": 1, "min_free_inodes_pct": 5,
               "required": True}],
    "tools": {},
}
(work / "health.json").write_text(json.dumps(config))
PY
run_step health python3 "$repo/roles/health/files/gpuforge-health" --config "$work/health.json" --mode adhoc --json

# One JSON file with every figure.
GPU_COUNT="$gpu_count" EFA_COUNT="$efa_count" INSTANCE_TYPE="$instance_type" HOST="$host" STAMP="$stamp" \
  python3 - "$work" "$out" <<'PY'
import json, os, re, sys
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])


def text(name, suffix="out"):
    path = work / f"{name}.{suffix}"
    return path.read_text(errors="replace") if path.exists() else None


def rc(name):
    value = text(name, "rc")
    return int(value) if value is not None else None


gpus = int(os.environ["GPU_COUNT"])
report = {
    "host": os.environ["HOST"],
    "time_utc": os.environ["STAMP"],
    "instance_type": os.environ["INSTANCE_TYPE"] or None,
    "gpu_count": gpus,
    "efa_count": int(os.environ["EFA_COUNT"]),
    "status": "ran" if gpus else "no_gpu",
}
if not gpus:
    report["message"] = "no NVIDIA GPU found: GPU checks, DCGM and NCCL not run"

fields = ["index", "name", "uuid", "pci_bus_id", "driver_version", "memory_total_mib", "persistence_mode",
          "temperature_c", "power_draw_w", "power_limit_w", "clocks_max_sm_mhz", "clocks_max_memory_mhz"]
if text("smi_query") is not None:
    report["gpus"] = [dict(zip(fields, (c.strip() for c in line.split(","))))
                      for line in text("smi_query").splitlines() if line.strip()]
    models = sorted({g.get("name", "") for g in report["gpus"]})
    report["gpu_models"] = models
q = text("smi_q")
if q is not None:
    for key, pattern in {"driver_version": r"Driver Version\s*:\s*(\S+)", "cuda_version": r"CUDA Version\s*:\s*(\S+)"}.items():
        match = re.search(pattern, q)
        report[key] = match.group(1) if match else None
if text("topo") is not None:
    report["topology"] = {"rc": rc("topo"), "matrix": text("topo")}

health = text("health")
try:
    report["health"] = json.loads(health) if health else None
except json.JSONDecodeError:
    report["health"] = {"rc": rc("health"), "output": health, "error": text("health", "err")}
if report.get("health") is not None and isinstance(report["health"], dict):
    report["health"]["rc"] = rc("health")

if text("dcgm") is not None:
    dcgm = {"level": 1, "rc": rc("dcgm"), "passed": rc("dcgm") == 0}
    try:
        dcgm["result"] = json.loads(text("dcgm"))
    except json.JSONDecodeError:
        dcgm["output"] = text("dcgm")
    report["dcgm_diag"] = dcgm
elif gpus:
    report["dcgm_diag"] = {"status": "not_present", "detail": "dcgmi not installed"}

tool = (text("nccl", "tool") or "").strip()
if tool:
    nccl = {"tool": tool, "rc": rc("nccl"), "gpus": gpus}
    output = text("nccl") or ""
    if tool == "nccl-tests":
        sizes = []
        for line in output.splitlines():
            cols = line.split()
            # out-of-place columns: size count type redop root time algbw busbw #wrong
            if len(cols) >= 9 and cols[0].isdigit() and cols[2] == "float":
                sizes.append({"bytes": int(cols[0]), "time_us": float(cols[5]), "algbw_gb_s": float(cols[6]),
                              "busbw_gb_s": float(cols[7]), "wrong": cols[8]})
        nccl["sizes"] = sizes
        avg = re.search(r"Avg bus bandwidth\s*:\s*([0-9.]+)", output)
        nccl["avg_busbw_gb_s"] = float(avg.group(1)) if avg else None
    else:
        try:
            nccl.update(json.loads(output.strip().splitlines()[-1]))
        except (json.JSONDecodeError, IndexError):
            nccl["output"] = output
    if nccl.get("sizes"):
        nccl["peak_busbw_gb_s"] = max(s["busbw_gb_s"] for s in nccl["sizes"])
    if nccl["rc"] != 0:
        nccl["error"] = (text("nccl", "err") or "")[-2000:]
    report["nccl_allreduce"] = nccl
elif gpus:
    report["nccl_allreduce"] = {"status": "not_run", "detail": "neither nccl-tests nor a CUDA build of PyTorch"}

out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
print(f"gpu-smoke: wrote {out}", file=sys.stderr)
PY

if [ "$gpu_count" -eq 0 ] && [ "$require_gpu" -eq 1 ]; then
  log "--require-gpu: no NVIDIA GPU on this machine"
  exit 1
fi
if [ "$gpu_count" -gt 0 ]; then
  # Failed steps are in the JSON; the exit status says whether any of them failed.
  failed=0
  for step in health dcgm nccl; do
    if [ -e "$work/$step.rc" ] && [ "$(cat "$work/$step.rc")" != 0 ]; then
      log "$step failed (exit $(cat "$work/$step.rc")); see $out"
      failed=1
    fi
  done
  exit "$failed"
fi
exit 0
