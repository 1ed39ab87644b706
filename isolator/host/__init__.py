"""The host's edges: what the core reaches the machine through.

    state/       the state store (SQLite): records, marks, schema and migrations
    devices.py   the NVIDIA device nodes under a dev root
    cpus.py      the machine's CPUs and memory nodes, and which a process may use
    system.py    the process table, the filesystem, the clock
    rootfs.py    paths inside a container image's rootfs
    mps.py       nvidia-cuda-mps-control: one control daemon per shared GPU in mps mode
    pidlock.py   ownership locks: an flock on a file holding the holder's pid

Each takes its roots in its constructor and implements a Protocol of ``isolator.core.ports``.
"""
