"""The GPU side: NVML (nvmlcall: the only pynvml user; nvml: the inventory and topology; health: its
watch) and kernel device events."""
