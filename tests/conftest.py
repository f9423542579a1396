import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """A small BPE tokenizer with the chat template, saved and reloaded as a serving engine would."""
    import environments
    from transformers import AutoTokenizer

    from posttrain.chat import train_tokenizer
    texts = [t.prompt + " " + str(t.demo) for d in environments.DOMAINS
             for t in environments.get(d).generate("train", 100, 0)]
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(texts, 400).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)
