"""gRPC: servicers that only translate, proto <-> model, the one error -> status map, the peer
gate, the serving loop, reflection, and the admin client."""
