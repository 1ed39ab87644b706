"""Pure decisions: which GPUs (allocator), which MIG devices (mig), which device rules (devices),
what recovery must do (reconcile), how GPU flags read (gpuflags). No I/O, no clock."""
