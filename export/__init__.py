"""fctkit.export — ONNX export with parity checks, TensorRT engines, signed model bundles."""
