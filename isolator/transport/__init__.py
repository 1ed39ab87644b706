"""The server side of both routes (gRPC, the command-module bridge's framed bytes), and the admin client.

    server.py      the sockets: the gRPC server (Isolator, Admin, health, reflection) and the bridge's
    settings.py    what the server side is told at start: sockets, who may call, bounds
    peergate.py    the public socket's SO_PEERCRED gate and the connection slots of both sockets
    bridge.py      the bridge socket: framed bytes <-> messages, ERROR/RETRY lines
    serving.py     admission of both routes on one event loop, the Watch wait, the hook pool
    handlers.py    request + the call's facts -> response or typed error (translate and call)
    convert.py     proto messages <-> the domain model
    status.py      a typed error -> its gRPC status, once
    wire.py        the conventions outside the messages (metadata keys, bridge tokens), from wire.proto
    logcontext.py  the hook and container each log line is about
    reflection.py  gRPC server reflection, both versions
    client.py      a small client of the socket, for the CLI and the tests

Nothing here decides: the core does (isolator/core/api.py is all the handlers may call).
"""
