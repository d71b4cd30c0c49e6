"""The ONNX Runtime backend: weight-sliced graphs per budget over one shared weight store, and the ONNX export."""
