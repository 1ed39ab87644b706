"""The GPU side.

    nvmlcall.py  the one door to NVML: the only module that imports pynvml
    nvml.py      the inventory: GPUs, topology, MIG devices, usage, processes, handover resets
    processes.py what each process on a GPU uses (the per-process and MPS-client calls)
    health.py    XID and ECC events and rescans, watched
    xids.py      which XIDs say the GPU is bad (data)
    uevents.py   kernel device events that change what NVML can see

Only ``nvmlcall`` touches pynvml; the core sees the inventory through ``core.ports.GpuInventory``.
"""
