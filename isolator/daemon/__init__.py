"""The daemon ``gpu-isolator serve``.

    main.py         the serving lifecycle: start, both sockets, SIGHUP, stop
    compose.py      the composition root: configuration -> the real edges -> the service
    jobs.py         the periodic jobs, one table (name, interval, work), and their loop
    options.py      every option written once: flag, config key, default, help, reloadable
    parsers.py      the options' value parsers
    config.py       the configuration resolved once at start (flags, TOML file, defaults), and its checks
    reload.py       what a SIGHUP may change without a restart
    workdir.py      one daemon per state directory (an flock on its pid file)
    ownership.py    what else one daemon owns (its sockets), claimed before it reads any state
    sdnotify.py     systemd's notify protocol: readiness, status, watchdog
    logfmt.py       the log formats (text, json)
    crashpoints.py  arming the crash points of the crash-consistency tests

Nothing else in the package builds a concrete edge; the decisions live in the core.
"""
