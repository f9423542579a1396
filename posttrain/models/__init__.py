"""The model layer: what a checkpoint is and how it runs, below the engines (posttrain.engines) and the trainers
(posttrain.rl, the stages). Nothing here imports from either.

- `preset`: the tiny presets `base` builds (a dense Llama, or GLM-5's own GlmMoeDsaForCausalLM) and checkpoints
  (save, load, check a folder; `restore`: what posttrain adds to a model transformers built);
- `added_weights`: loading the weights posttrain adds (DSA indexers, the MTP layer) from a checkpoint;
- `glm5`: GLM-5-shaped checkpoints (config rules, the stable DSA indexer, bound to a model's own indexers);
- `moe`: mixture-of-experts care (balancing, expert load, routing record and replay, unfused experts);
- `attention`, `packed_attention`, `dsa`: attention implementations (padding-free packed rows, DeepSeek sparse
  attention with its indexer);
- `mtp`: the multi-token-prediction draft layer;
- `head`: token log-probabilities, entropies and reverse KL through the logits or the fused kernels (`logits`:
  whether a model's logits are its last hidden state times its output embeddings, which they and `mtp` rely on);
- `kv_cache`, `prefix`: caches for decoding, and the model's output at every completion position with each
  distinct prompt run once."""
