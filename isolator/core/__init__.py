"""The service core: the Mesos hooks, recovery and the admin views over injected edges.

Read it from the file names (docs/architecture.md draws the whole request path):

    service.py   IsolatorService: composes the three parts below over one Core
    hooks.py     prepare, isolate, update, watch, usage, status, cleanup
    recovery.py  start-up booking, Recover, reaping containers whose cgroup vanished
    admin.py     the views behind the gpu-isolator CLI, and release
    context.py   Core: the edges, the allocator, the locks and the steps the parts share
    locks.py     per-container locks
    ports.py     the edges as typing.Protocols (cgroups, state, volumes, NVML, devices, /proc, clock)
    api.py       what the gRPC servicers and the bridge may call
"""
