"""The ingress replica's process: the Serve deployment and its HTTP edge, the engine client, routing and failover."""
