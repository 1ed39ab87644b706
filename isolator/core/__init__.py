"""The service core: the Mesos hooks, recovery and the admin views over injected edges.

Read it from the file names (docs/architecture.md draws the whole request path):

    api.py       IsolatorApi: what the transport's handlers (both routes) may call
    service.py   IsolatorService: composes the three parts below over one Core
    hooks.py     Hooks: the hooks below together
    prepare.py   prepare (top-level and nested containers, the launch)
    isolate.py   isolate (the pid rule is policy/placement.py)
    update.py    update (grow, shrink, the cpuset following)
    watch.py     watch ("is there a limitation now"), usage, status
    usage.py     what each container's processes use on the devices it holds (Usage, admin, metrics)
    cleanup.py   cleanup
    recovery.py  start-up booking, Recover, reaping containers whose cgroup vanished, the drift audit
    admin.py     the views behind the gpu-isolator CLI, release, undrain
    handover.py  the check of released GPUs before they are handed out again
    maintenance.py  an operator's maintenance drains, by GPU UUID, and their history
    healthmarks.py  the XID/ECC marks kept across restarts: restored at start, kept or dropped on change
    mps.py       the MPS control daemons of shared GPUs in mps mode: started, supervised, stopped
    context.py   Core: the edges, the books, the locks and the steps the parts share
    booking.py   which GPUs are held (the books and their lock)
    grant.py     what the kernel grants (devices cgroups, cpuset)
    changes.py   what an open Watch is told of (subscriptions; nothing here waits)
    locks.py     per-container locks
    ports.py     the edges as typing.Protocols (cgroups, state, volumes, NVML, devices, /proc, clock)
    absent.py    null objects for the optional edges (no volume root, no cpuset, no MPS)
"""
