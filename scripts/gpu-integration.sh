#!/usr/bin/env bash
# Check a GPU agent before it takes work: run the `gpu` test suite against the machine's own
# driver, NVML, device nodes and cgroups (no simulated host). Needs root. Prints the driver
# version and GPU models first, then what passed and what skipped and why.
# The sidecars the suite starts run with --drain-check off (no handover resets); the MPS test sets
# GPU 0's compute mode and back: GI_GPU_KEEP_SETTINGS=1 skips it (a shared or lent GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then
    echo "gpu-integration: must run as root (it creates cgroups and mount namespaces)" >&2
    exit 2
fi
if ! command -v nvidia-smi >/dev/null; then
    echo "gpu-integration: no nvidia-smi on PATH: this is not a GPU host with a driver" >&2
    exit 2
fi
echo "== host"
nvidia-smi --query-gpu=index,name,driver_version,pci.bus_id,memory.total,mig.mode.current --format=csv
uname -r
echo "== gpu suite"
make test-gpu PYTEST_ARGS="${PYTEST_ARGS:--v}"
