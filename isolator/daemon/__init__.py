"""The daemon: composition root (main), configuration, sd_notify, log formats, crash points."""
