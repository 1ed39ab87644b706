"""Exit 0 when this machine has an NVIDIA GPU NVML can see, else 1 with the reason on stderr.

`make test-gpu` runs it first so that the real-GPU suite never "passes" on a machine without a GPU
(every test would skip): it fails unless ALLOW_NO_GPU=1 says skipping is fine.
"""

from __future__ import annotations

import sys


def gpu_count() -> tuple[int, str]:
    """(GPUs NVML reports, "" or why none)."""
    try:
        import pynvml
    except ImportError as exc:
        return 0, f"nvidia-ml-py is not installed ({exc})"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return 0, f"NVML cannot be initialised: {exc}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        return 0, f"NVML cannot count GPUs: {exc}"
    finally:
        pynvml.nvmlShutdown()
    return count, "" if count else "NVML reports no GPU"


def main() -> int:
    count, why = gpu_count()
    if count:
        print(f"gpu_present: {count} GPU(s)")
        return 0
    print(
        f"make test-gpu: no NVIDIA GPU on this machine ({why}); run it on a GPU host, or set ALLOW_NO_GPU=1"
        " to let every gpu test skip",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
