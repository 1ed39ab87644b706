"""Which XIDs say the GPU is bad, and which only say the application is: data, no I/O."""

# XIDs caused by the application rather than the GPU: 13 graphics engine exception, 31 GPU memory
# page fault, 43 GPU stopped processing, 45 preemptive cleanup, 68 video processor exception, 109
# context switch timeout. k8s-device-plugin ignores the same list (k8s-topology.md §2.4).
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)
