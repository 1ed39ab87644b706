"""The transport's handlers, admission pool and Watch wait, in-process."""
