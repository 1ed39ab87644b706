#!/usr/bin/env bash
# One run of the real-GPU suite (marker `gpu`) on a lent GPU machine without network access, as
# root: the facts of the machine first, then the suite with -rs -v, all of it in $OUT/log (and
# $OUT/junit.xml). Python packages come as wheels in .whl/ (installed to /tmp/site, first on
# PYTHONPATH), the package itself from the checkout (PYTHONPATH=.); nothing is compiled (the gpu
# tests need neither the fake NVML nor the compiled bridge). `make test-gpu` would create a venv
# and install from the network instead.
#
# Never changes the GPU's settings: GI_GPU_KEEP_SETTINGS=1 skips the MPS test (it sets the compute
# mode), and the sidecars the suite starts run with --drain-check off (no handover resets).
# Extra pytest arguments (e.g. a -k selection for a rerun) are passed through.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-run}
mkdir -p "$OUT"
LOG=$OUT/log
export PYTHONUNBUFFERED=1 GI_GPU_KEEP_SETTINGS=1

settings() {
    nvidia-smi --query-gpu=index,compute_mode,persistence_mode,mig.mode.current,clocks.applications.graphics,clocks.applications.memory,clocks.default_applications.graphics,clocks.default_applications.memory --format=csv
}

facts() {
    echo "== date"; date -u
    echo "== uname / id"; uname -a; id; cat /proc/cmdline
    echo "== nvidia-smi"; nvidia-smi
    nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total --format=csv
    echo "== GPU settings before"; settings
    echo "== cgroups"; mount | grep -i cgroup; echo "-- /proc/self/cgroup"; cat /proc/self/cgroup
    echo "-- /sys/fs/cgroup"; ls /sys/fs/cgroup | head -40
    for f in cgroup.controllers cgroup.subtree_control; do
        echo "-- $f: $(cat /sys/fs/cgroup/$f 2>&1)"
    done
    grep -E "^(devices|cpuset)" /proc/cgroups
    echo "== device nodes"; ls -l /dev/nvidia* 2>&1; ls -l /dev/nvidia-caps 2>&1
    echo "== driver files"
    ldconfig -p | grep -E "libnvidia-ml|libcuda\.so" || echo "(none in ld.so.cache)"
    timeout 30 find /usr /lib /lib64 /opt -name 'libnvidia-ml.so*' 2>/dev/null | head -20
    mount | grep -i nvidia
    ls -l /usr/local/nvidia /usr/local/nvidia/lib64 2>&1 | head -40
    echo "== tools"
    for t in nvidia-smi nvidia-cuda-mps-control unshare gcc python3 /usr/bin/python3; do
        printf '%s: %s\n' "$t" "$(command -v "$t" || echo missing)"
    done
    /usr/bin/python3 --version 2>&1
    python3 --version
    echo "== device's python packages"
    python3 -m pip list 2>/dev/null | grep -iE "^(grpcio|protobuf|nvidia-ml-py|prometheus|pyyaml|pytest|typing)" || true
}

{
    facts
    echo "== carried wheels"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 3; }
} 2>&1 | tee "$LOG"
[ "${PIPESTATUS[0]}" = 0 ] || exit 3
export PYTHONPATH=/tmp/site:$PWD

{
    python3 -c "
import grpc, google.protobuf, pynvml, yaml, prometheus_client, grpc_health, grpc_reflection
print('grpcio', grpc.__version__, '| protobuf', google.protobuf.__version__, '| pynvml', pynvml.__file__)
import isolator.rpc.isolator_pb2, isolator.rpc.isolator_pb2_grpc
print('generated code imports')
"
    echo "== gpu_present"; python3 scripts/gpu_present.py
    timeout_opt=()
    python3 -c "import pytest_timeout" 2>/dev/null && timeout_opt=(--timeout=150)
    echo "== gpu suite"
    timeout 330 python3 -m pytest -p no:cacheprovider -m gpu -rs -v "${timeout_opt[@]}" --junitxml="$OUT/junit.xml" \
        tests/system/test_gpu_host.py tests/system/test_gpu_mps.py tests/system/test_gpu_mps_fault.py \
        tests/system/test_volume_build.py tests/contract/test_process_usage.py "$@"
    echo "pytest exit: $?"
    echo "== GPU settings after"; settings
    echo "== leftovers"; ls -d /tmp/gi-* 2>/dev/null; nvidia-smi --query-compute-apps=pid,name --format=csv
} 2>&1 | tee -a "$LOG"
