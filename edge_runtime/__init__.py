"""fctkit.edge_runtime — the on-device library. Runs without torch (numpy, onnxruntime,
grpcio, cryptography)."""
