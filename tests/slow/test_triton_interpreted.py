"""The Triton kernels themselves against their plain-torch references, under TRITON_INTERPRET=1 in a child process
(how a machine without a GPU checks the Triton code). `make test-slow`: the interpreter ran it in 9 minutes on a slow
2-core machine."""
from kernels import selfcheck

TOL = 1e-3  # fp32 against fp32 references at |values| of a few units: errors are ~1e-5


def test_triton_kernels_match_their_references_under_the_interpreter():
    errors = selfcheck.interpreted(timeout=1800)
    assert errors.pop("triton") == 1.0  # the Triton code ran, not the torch fallback
    assert set(errors) == {"logprob_forward", "logprob_backward", "reverse_kl_forward", "reverse_kl_backward",
                           "logprob_loss", "reverse_kl_loss", "logprob_weighted_loss", "w4a8", "w4a8_fused_quant", "w4a8_grouped", "w4a8_64_rows",
                           "quantize_activations", "int_linear", "int_experts", "dsa_topk", "dsa_attention_forward",
                           "dsa_attention_backward"}
    assert max(errors.values()) < TOL, errors
