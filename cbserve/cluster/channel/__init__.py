"""cbserve's own sockets, both ends: the framing, the typed messages, the ingress <-> engine channel and the
scheduler -> worker step channel."""
