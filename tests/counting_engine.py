"""A third train engine, for tests/test_pipeline_smoke.py: the torch engine counting the calls each stage makes on it.
It is one module; registering it is one line in posttrain.engines.registry.TRAIN."""
from collections import Counter

from posttrain.engines.torch_train import TorchTrainEngine


class CountingEngine(TorchTrainEngine):
    calls: Counter = Counter()

    @classmethod
    def for_lm(cls, *args, **kw):
        cls.calls["for_lm"] += 1
        return super().for_lm(*args, **kw)

    @classmethod
    def from_checkpoint(cls, *args, **kw):
        cls.calls["from_checkpoint"] += 1
        return super().from_checkpoint(*args, **kw)

    def forward_backward(self, *args, **kw):
        self.calls["forward_backward"] += 1
        return super().forward_backward(*args, **kw)

    def logprob_losses(self, *args, **kw):
        self.calls["logprob_losses"] += 1
        return super().logprob_losses(*args, **kw)

    def step(self, *args, **kw):
        self.calls["step"] += 1
        return super().step(*args, **kw)
