"""Triton kernels, each beside its plain-torch reference (the DSA indexer arrives with the kernels work)."""
