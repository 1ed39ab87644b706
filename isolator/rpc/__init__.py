"""Generated protobuf and gRPC modules (``make proto``). Only the server and clients import these."""
