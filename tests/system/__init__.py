"""The behaviour suites: daemons, sockets, kernels, cgroups, the CLI, crash and load tests."""
