"""W4A8 quantization: GPTQ rounding (gptq.py), the integer linear layer (int_matmul.py), a MoE layer's experts in
grouped launches (int_experts.py), the compressed-tensors loader (int_linear.py) and the rollouts' own W4A8 copy of
the policy (rollout.py); the node that quantizes the generalist and checks it is posttrain/stages/quantize.py."""
