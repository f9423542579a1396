"""W4A8 quantization: GPTQ rounding (gptq.py), the integer linear layers and compressed-tensors loader
(int_linear.py), and the node that quantizes the generalist and checks it (stage.py)."""
