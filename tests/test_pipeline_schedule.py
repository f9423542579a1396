"""The megatron engine's 1F1B order (posttrain.engines.megatron.pipeline_stages.one_f_one_b) on a stand-in pipeline
that records what each stage runs: the two-rank runs in tests/test_megatron.py check the numbers, this checks the
order."""
import pytest
import torch

from posttrain.engines.megatron.pipeline_stages import StageDone, one_f_one_b


class Recorder:
    """A pipeline stage without the sends: `forward` and `backward` write down which micro-batch they ran."""

    def __init__(self, size: int, stage: int):
        self.size, self.stage, self.last = size, stage, stage == size - 1
        self.received, self.sent, self.pending, self.events = [], [], None, []

    def forget(self) -> None:
        self.received.clear()
        self.sent.clear()

    def forward(self, i: int) -> torch.Tensor:
        self.events.append(f"F{i}")
        self.sent.append(i)  # what the stage's backward will need
        if not self.last:
            raise StageDone
        return torch.tensor(float(i))

    def backward(self, loss) -> None:
        assert (loss is not None) == self.last
        self.events.append(f"B{self.sent[0]}")
        self.forget()


def _in_flight(events: list[str]) -> int:
    """The most micro-batches forwarded and not yet backpropagated at once: the activations a stage holds."""
    held = most = 0
    for e in events:
        held += 1 if e[0] == "F" else -1
        most = max(most, held)
    return most


# Megatron's non-interleaved schedule at 4 stages and 6 micro-batches: stage s runs 3 - s forwards ahead
ORDER = {0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5", 1: "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
         2: "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5", 3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"}


def test_each_stage_runs_megatrons_1f1b_order():
    for stage, order in ORDER.items():
        pipe = Recorder(4, stage)
        total = one_f_one_b(pipe, pipe.forward, 6)
        assert " ".join(pipe.events) == order
        assert total == (15.0 if pipe.last else None)  # the last stage's losses, summed
        assert pipe.pending is None  # every send waited for


@pytest.mark.parametrize("size,micro", [(2, 4), (4, 2), (1, 3), (8, 16)])
def test_a_stage_holds_at_most_as_many_micro_batches_as_stages_from_it_to_the_end(size, micro):
    for stage in range(size):
        pipe = Recorder(size, stage)
        one_f_one_b(pipe, pipe.forward, micro)
        assert sorted(pipe.events) == sorted([f"F{i}" for i in range(micro)] + [f"B{i}" for i in range(micro)])
        assert _in_flight(pipe.events) == min(size - stage, micro)
