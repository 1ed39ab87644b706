"""Pure decisions: no I/O, no clock.

    request.py     what a container asks for (gpus, mig-<profile>, gpu_shares): one kind, read once
    allocator.py   which whole GPUs: the first-fit and topology policies, and the book
    fabric.py      how well each pair of GPUs is connected
    search.py      the topology search for the best set on a fabric
    mig.py         MIG devices as allocatable units
    shares.py      shares of a GPU: which GPUs are shared, where shares go
    devices.py     which device rules a container gets
    affinity.py    which CPUs and memory nodes, from the GPUs' locality
    launch.py      the launch environment Prepare hands Mesos
    placement.py   which pid standalone Isolate may move
    reconcile.py   what recovery does with records, grants and Mesos's containers
    adopt.py       cgroups under our root with no record, at start-up
    drift.py       how a record and the kernel's grant differ
    handover.py    may a released GPU be handed out again
    gpuflags.py    which GPUs the sidecar manages, from the agent's flags
    attributes.py  the agent's --attributes for its GPUs
    usage.py       what each container uses: NVML's processes attributed by cgroup

Each imports only the vocabulary (tests/unit/test_imports.py holds it so).
"""
