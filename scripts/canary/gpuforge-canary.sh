#!/usr/bin/env bash
# gpuforge-canary.sh: the node side of `gpuforge canary` (scripts/gpuforge/ami/canary.py).
#
# It is not shipped on the image: `gpuforge canary` sends it, with scripts/gpu-smoke.sh and
# data/instance_types.yml, in the SSM Run Command it starts (AWS-RunShellScript), so the canary of an
# image can change without baking again and nothing on the image is trusted to judge itself beyond the
# health script under test. It runs as root (SSM Run Command runs AWS-RunShellScript as root).
#
# Usage (from the unpacked bundle; stdout carries only what the caller parses, logs go to stderr):
#   gpuforge-canary.sh keygen RUN_ID            2 nodes, on the leader: make a key pair for this run,
#                                               print its public key (in one JSON)
#   gpuforge-canary.sh authorize RUN_ID KEY     2 nodes, on the peer: let the leader's key log in as root
#                                               (Open MPI's mpirun starts its remote daemons over ssh)
#   gpuforge-canary.sh check RUN_ID TYPE        on every node: the image's health checks and the GPU
#                                               smoke test; prints one JSON
#   gpuforge-canary.sh allreduce RUN_ID LEADER_IP PEER_IP
#                                               2 nodes, on the leader, after check ended on both:
#                                               nccl-tests all_reduce over both nodes; prints one JSON
#
# Environment (all optional; the lab points them at its stand-ins):
#   GPUFORGE_HEALTH        the image's health script (default /usr/local/sbin/gpuforge-health)
#   GPUFORGE_NCCL_TESTS    all_reduce_perf (default /opt/nccl-tests/build/all_reduce_perf)
#   GPUFORGE_MPIRUN        mpirun (default /opt/amazon/openmpi/bin/mpirun)
#   GPUFORGE_CANARY_MAX_BYTES  largest all_reduce message (default 8G, the size of the p5 baseline rows
#                          in data/nccl_baselines.yml, so that the bandwidth can be judged)
#   GPUFORGE_CANARY_TIMEOUT    seconds per step (default 1800)
set -euo pipefail

# The bundle's root (laid out as a checkout: scripts/, data/), two levels above this script.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
health="${GPUFORGE_HEALTH:-/usr/local/sbin/gpuforge-health}"
nccl_tests="${GPUFORGE_NCCL_TESTS:-/opt/nccl-tests/build/all_reduce_perf}"
mpirun="${GPUFORGE_MPIRUN:-/opt/amazon/openmpi/bin/mpirun}"
max_bytes="${GPUFORGE_CANARY_MAX_BYTES:-8G}"
step_timeout="${GPUFORGE_CANARY_TIMEOUT:-1800}"
ssh_dir=/root/.ssh

log() { echo "gpuforge-canary: $*" >&2; }
die() { log "$*"; exit 2; }

# Run ids come from gpuforge canary (canary.new_run_id); anything else is refused before use in paths.
check_run_id() {
  case "$1" in
    canary-[0-9a-z]*) case "$1" in *[!0-9a-z-]*) die "bad run id $1" ;; esac ;;
    *) die "bad run id $1" ;;
  esac
}

keygen() {
  local key="$ssh_dir/$1"
  install -d -m 0700 "$ssh_dir"
  [ -f "$key" ] || ssh-keygen -q -t ed25519 -N "" -C "$1" -f "$key" >&2
  RUN_ID="$1" KEY="$(cat "$key.pub")" python3 -c \
    'import json, os; print(json.dumps({"run_id": os.environ["RUN_ID"], "step": "keygen", "public_key": os.environ["KEY"]}))'
}

authorize() {
  install -d -m 0700 "$ssh_dir"
  case "$2" in ssh-ed25519\ *) ;; *) die "not an ed25519 public key" ;; esac
  # The key is the only thing on its line; the instance is terminated after the canary.
  grep -qxF "$2" "$ssh_dir/authorized_keys" 2>/dev/null || echo "$2" >>"$ssh_dir/authorized_keys"
  chmod 0600 "$ssh_dir/authorized_keys"
  RUN_ID="$1" python3 -c 'import json, os; print(json.dumps({"run_id": os.environ["RUN_ID"], "step": "authorize"}))'
}

# run_step NAME CMD...: stdout/stderr/rc under $work/NAME.*, never stopping the script.
run_step() {
  local name="$1" rc=0
  shift
  timeout "$step_timeout" "$@" >"$work/$name.out" 2>"$work/$name.err" || rc=$?
  echo "$rc" >"$work/$name.rc"
}

gpu_count() {
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >"$work/smi_list" 2>/dev/null; then
    grep -c '^GPU [0-9]' "$work/smi_list" || true
  else
    echo 0
  fi
}

all_reduce() {
  local run_id="$1" leader="$2" peer="$3" gpus
  gpus="$(gpu_count)"
  if [ "$gpus" -lt 1 ]; then
    echo "no GPU listed by nvidia-smi: all_reduce not run" >"$work/nccl.err"
    echo 3 >"$work/nccl.rc"
    return 0
  fi
  # One rank per GPU on each node (-N), launched by the EFA installer's Open MPI as AWS's EFA and NCCL
  # guide does (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start-nccl.html: mpirun -n
  # 2*GPUs -N GPUs, --mca pml ^cm, --bind-to none, all_reduce_perf -b 8 -f 2 -g 1 -c 1). The
  # environment is scripts/slurm/nccl-allreduce.sbatch's (EFA provider forced, NCCL INIT/NET logging
  # that `gpuforge nccl-report` reads to prove the run used EFA).
  run_step nccl "$mpirun" --allow-run-as-root \
    -n "$((2 * gpus))" -N "$gpus" --host "$leader:$gpus,$peer:$gpus" \
    --mca plm_rsh_args "-i $ssh_dir/$run_id -o StrictHostKeyChecking=accept-new -o UserKnownHostsFile=$work/known_hosts" \
    --mca pml ^cm --bind-to none \
    -x "LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:/opt/amazon/openmpi/lib:/usr/local/cuda/lib64" \
    -x FI_PROVIDER=efa -x FI_EFA_FORK_SAFE=1 \
    -x NCCL_DEBUG=INFO -x NCCL_DEBUG_SUBSYS=INIT,NET -x "NCCL_SOCKET_IFNAME=^docker,lo,veth" \
    "$nccl_tests" -b 8 -e "$max_bytes" -f 2 -g 1 -c 1 -n 20
}

new_work() {
  work="$(mktemp -d /tmp/gpuforge-canary.XXXXXX)"
  trap 'rm -rf "$work"' EXIT
}

check() {
  local run_id="$1" itype="$2"
  new_work
  # The image's own health script with the image's own configuration: what the fleet will run.
  log "health checks ($health)"
  run_step health "$health" --mode adhoc --json
  # gpu-smoke.sh looks for the health script and the instance types beside itself, as in a checkout:
  # give it the image's health script (the one under test), not a copy from the caller.
  mkdir -p "$here/roles/health/files"
  ln -sfn "$health" "$here/roles/health/files/gpuforge-health"
  log "GPU smoke test"
  run_step smoke bash "$here/scripts/gpu-smoke.sh" --out "$work/smoke.json" --instance-type "$itype" \
    --require-gpu --timeout "$step_timeout"
  report "$run_id" check
}

allreduce() {
  new_work
  log "nccl-tests all_reduce over $2 and $3"
  all_reduce "$1" "$2" "$3"
  report "$1" allreduce
}

# report RUN_ID STEP: one JSON document on stdout with what the steps left in $work.
report() {
  RUN_ID="$1" STEP="$2" python3 - "$work" <<'PY'
import json, os, socket, sys
from pathlib import Path

work = Path(sys.argv[1])


def read(name):
    path = work / name
    return path.read_text(errors="replace") if path.exists() else None


def step(name):
    rc = read(f"{name}.rc")
    if rc is None:
        return None
    return {"rc": int(rc), "stderr": (read(f"{name}.err") or "")[-4000:]}


def parsed(text):
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return None


result = {"format": 1, "run_id": os.environ["RUN_ID"], "step": os.environ["STEP"], "host": socket.gethostname()}
if os.environ["STEP"] == "check":
    result["health"] = {**(step("health") or {}), "report": parsed(read("health.out"))}
    result["smoke"] = {**(step("smoke") or {}), "report": parsed(read("smoke.json"))}
else:
    # The whole log: the caller judges it with gpuforge nccl-report's code against the baselines.
    result["nccl"] = {**(step("nccl") or {}), "log": read("nccl.out") or ""}
print(json.dumps(result))
PY
}

[ $# -ge 2 ] || die "usage: $0 keygen|authorize|check|allreduce RUN_ID ..."
command="$1"
check_run_id "$2"
case "$command" in
  keygen) keygen "$2" ;;
  authorize) [ $# -eq 3 ] || die "authorize RUN_ID KEY"; authorize "$2" "$3" ;;
  check) [ $# -eq 3 ] || die "check RUN_ID TYPE"; check "$2" "$3" ;;
  allreduce) [ $# -eq 4 ] || die "allreduce RUN_ID LEADER_IP PEER_IP"; allreduce "$2" "$3" "$4" ;;
  *) die "unknown command $command" ;;
esac
