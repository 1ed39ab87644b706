"""The admin CLI ``gpu-isolator``: the only code that prints.

    main.py        dispatch: parse, run the command, map its failure to an exit code
    parser.py      the one description of every command and flag
    admin.py       the admin commands, one row each: arguments, RPC, request, exit rule, renderer
    render.py      an Admin answer as text for people, or as JSON/YAML
    offline.py     the commands that need no running sidecar: serve, resources, attributes, cdi, config
    unit.py        install-unit: the shipped systemd unit filled in for this installation
    exits.py       the exit codes and the usage error
    completion.py  shell completion (bash, zsh, fish), generated from the parser

Each admin command is written once, as its row in admin.py and its renderer.
"""
