"""fctkit.server — the gRPC server: registry, artifact streaming, encrypted image vault, fleet."""
