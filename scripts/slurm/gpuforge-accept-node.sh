#!/bin/bash
# gpuforge accept, stage 1: one node alone. `gpuforge accept` runs this on every node at once, one Slurm
# task per node, and reads what it prints between its @@ markers (gpuforge.accept.nodecheck); it is passed to each task as `bash -c`, so no node needs a copy:
#   1. the node's health checks, deep: gpuforge-health --json at the dcgmi diag level asked for;
#   2. every EFA device's loopback: fi_pingpong server and client on this node, over that device;
#   3. an all_reduce over the node's own GPUs (NVLink), judged against the type's 1-node baseline.
# It judges nothing itself and always exits 0: a step that fails would only hide what it printed.
#
# Usage: gpuforge-accept-node.sh HEALTH DCGM_LEVEL EFA_BIN GPUS ALL_REDUCE MAX_BYTES ITERS
set -u

health="$1" dcgm_level="$2" efa_bin="$3" gpus="$4" all_reduce="$5" max_bytes="$6" iters="$7"

echo "@@gpuforge-accept node=${SLURMD_NODENAME:-$(hostname)}"

echo "@@health begin"
if [[ -x "$health" ]]; then
    "$health" --mode adhoc --json --dcgm-level "$dcgm_level" 2>&1
    rc=$?
    echo  # The marker on a line of its own, whatever the last line printed.
    echo "@@health end rc=$rc"
else
    echo "@@health end rc=missing"
fi

# The loopback AWS's Deep Learning Containers run as their EFA sanity test (aws/deep-learning-containers
# test/dlc_tests/container_tests/bin/efa/efa_test.sh): fi_pingpong -e rdm -p efa as a server, then as a
# client of localhost, with FI_EFA_ENABLE_SHM_TRANSFER=0 so that the bytes cross the EFA device rather
# than shared memory. Here once per device (-d DOMAIN from fi_info -p efa -t FI_EP_RDM), all devices at
# once, each on a control port of its own given to both sides (fi_pingpong(1): -B on the server, -P on
# the client): a p5's 32 loopbacks take seconds. libfabric 2.x lists every device twice, first as fabric
# efa-direct, then as efa (ofiwg/libfabric v2.6.0, prov/efa/src/efa_prov.c lines 94-123): one loopback
# per unique domain.
if [[ -x "$efa_bin/fi_info" && -x "$efa_bin/fi_pingpong" ]]; then
    domains=$("$efa_bin/fi_info" -p efa -t FI_EP_RDM 2>/dev/null | awk '$1 == "domain:" {print $2}' | sort -u)
    [[ -n "$domains" ]] || echo "@@efa none reason=fi_info -p efa -t FI_EP_RDM lists no EFA domain"
    work=$(mktemp -d)
    port=47600
    for domain in $domains; do
        (
            FI_EFA_ENABLE_SHM_TRANSFER=0 timeout 30 "$efa_bin/fi_pingpong" -p efa -e rdm -d "$domain" -B "$port" \
                >/dev/null 2>&1 &
            server=$!
            sleep 1
            FI_EFA_ENABLE_SHM_TRANSFER=0 timeout 20 "$efa_bin/fi_pingpong" -p efa -e rdm -d "$domain" \
                -P "$port" localhost >"$work/$domain.out" 2>&1
            rc=$?
            wait "$server"
            server_rc=$?
            [[ $rc -eq 0 ]] && rc=$server_rc
            echo "$rc" >"$work/$domain.rc"
        ) &
        port=$((port + 1))
    done
    wait
    for domain in $domains; do
        echo "@@efa device=$domain rc=$(cat "$work/$domain.rc") $(tail -n 1 "$work/$domain.out")"
    done
    rm -rf "$work"
else
    echo "@@efa none reason=$efa_bin/fi_pingpong not found (the EFA installer puts it there)"
fi

echo "@@allreduce begin"
if (( gpus < 2 )); then
    echo "@@allreduce end rc=single-gpu"
elif [[ -x "$all_reduce" ]]; then
    # One process driving every GPU of the node (-g), started as its own MPI singleton: the launcher's
    # variables would otherwise join every node's process into one world.
    (
        for name in $(compgen -e); do
            case "$name" in PMI_* | PMIX_* | OMPI_* | SLURM_*) unset "$name" ;; esac
        done
        "$all_reduce" -b 8 -e "$max_bytes" -f 2 -g "$gpus" -c 1 -n "$iters" 2>&1
    )
    rc=$?
    echo
    echo "@@allreduce end rc=$rc"
else
    echo "@@allreduce end rc=missing"
fi
exit 0
