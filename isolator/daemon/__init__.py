"""The daemon: the composition root (compose), the periodic jobs (jobs), the serving lifecycle (main), the
options and the configuration (options, parsers, config), SIGHUP, sd_notify, log formats, crash points."""
