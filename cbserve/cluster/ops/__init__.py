"""Operations: Prometheus metrics and their discovery, CPU priority and node tuning, the request path's trace, the
actors' names."""
