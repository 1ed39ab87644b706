"""The GPU side: the only pynvml user (nvml: inventory, topology, health) and kernel device events."""
