"""`python -m posttrain.tools.loadcheck CHECKPOINT PROMPT`: load a checkpoint (plain or W4A8) in this fresh
process, answer PROMPT greedily through the chat template, print one JSON line with the answer and the
process's memory: its peak RSS (at this scale set by the libraries' import, not the model) and how much
its RSS grew from just before loading to after generating (what the model costs). The quantize stage
runs it on its export and on the unquantized model."""
from __future__ import annotations

import ctypes
import gc
import json
import resource
import sys

import psutil
import torch

from posttrain.chat import pad_id, render_ids
from posttrain.quant.int_linear import load_any, model_bytes


def main(path: str, prompt: str, max_new_tokens: int = 48) -> dict:
    proc, libc = psutil.Process(), ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    rss_before = proc.memory_info().rss
    model, tok = load_any(path)
    ids = torch.tensor([render_ids(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad_id(tok))[0, ids.shape[1]:]
    gc.collect()
    libc.malloc_trim(0)  # hand freed pages back, so RSS counts what is still held
    return {"text": tok.decode(gen), "generated_tokens": len(gen), "model_bytes": model_bytes(model),
            "rss_growth_bytes": proc.memory_info().rss - rss_before,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m posttrain.tools.loadcheck CHECKPOINT_DIR PROMPT")
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
