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


PARITY_ENV = ("from environments.base import Task, collect, verify_number\n"
              "def generate(split, n, seed, **_):\n"
              "    def make(rng):\n"
              "        x = rng.randint(0, 10**6)\n"
              "        return str(x), Task(id='', domain='parity', split='', prompt=f'Parity of {x}?',\n"
              "                            answer=str(x % 2), demo=[{'role': 'assistant', 'reasoning_content': '',\n"
              "                                                      'content': str(x % 2)}])\n"
              "    return collect('parity', split, n, seed, make)\n"
              "verify = verify_number\n")


@pytest.fixture
def parity_env(tmp_path, monkeypatch):
    """A user's environment outside the repo: module `parity_env` on sys.path, forgotten after the test."""
    import environments
    (tmp_path / "parity_env.py").write_text(PARITY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "parity_env"
    environments.REGISTRY.pop("parity", None)
    sys.modules.pop("parity_env", None)


@pytest.fixture(scope="module")
def megatron_groups():
    """For a module whose tests open the megatron engine's world of one in this process: closed after it, since
    later tests open their own process groups."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def gloo_pair():
    """Two warm processes for the two-rank tests (tests/gloo_pair.py): `gloo_pair.spawn(fn, args)`."""
    from tests.gloo_pair import Pair
    pair = Pair()
    yield pair
    pair.close()


# the longest files first: under `make test`'s two workers (xdist, a file to a worker at a time) the smoke-DAG
# modules then run beside the many short files instead of after them
LONG = ("test_pipeline_smoke.py", "test_figures.py", "test_real_models.py", "test_glm5_pipeline.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in LONG)  # stable: each file's own order is kept
