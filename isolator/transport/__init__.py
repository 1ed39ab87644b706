"""The server side of both routes (gRPC, the command-module bridge's framed bytes): plain handlers
(proto <-> model), each route's one error mapping, the peer gate and its connection slots, admission,
reflection; and the admin client."""
