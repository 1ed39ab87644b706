"""GPU isolator sidecar for Apache Mesos agents.

The request path reads in module names: server -> service -> allocator, devices/cgroups, volumes.
"""

__version__ = "0.1.0"
