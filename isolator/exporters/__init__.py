"""What the sidecar exports for tools beside it.

    metrics.py   Prometheus metrics on an opt-in address, and the server edge's observer
    jobmap.py    dcgm-exporter's HPC job mapping: one file per GPU index
    cdi.py       a CDI spec of the managed GPUs, MIG devices and driver volume

Each is started by the daemon only when its flag asks for it.
"""
