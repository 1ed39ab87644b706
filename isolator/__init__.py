"""GPU isolator sidecar for Apache Mesos agents.

The request path reads in package names (docs/architecture.md draws it):

    bridge/      the agent's command-module route, client side (an executable per hook)
    transport/   the server side of both routes: sockets, admission, handlers, proto <-> model
    core/        the hooks, recovery and admin views over the ports they are given
    policy/      pure decisions: which GPUs, MIG units, shares, device rules, CPUs
    cgroups/     the kernel's devices (v1 whitelist, v2 eBPF) and cpuset controllers
    gpu/         NVML and kernel device events
    host/        the state store, /dev, /proc, CPUs, MPS daemons
    exporters/   metrics, dcgm-exporter job mapping, CDI
    daemon/      the composition root and its configuration
    cli/         the admin commands (the only code that prints)
    testing/     shipped fakes and harnesses; simhost/: the simulated GPU host
    rpc/         generated code (``make proto``)
    model.py, errors.py, crashpoints.py, devicerule.py: the vocabulary every layer shares
"""

__version__ = "0.1.0"
