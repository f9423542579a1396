"""Pipeline parallelism for the megatron train engine: each pipeline rank holds a contiguous slice of the decoder
layers (the first also the embeddings, the last the final norm and the output layer), and a call's hidden states
go from stage to stage over torch.distributed's point-to-point sends.

Why not Megatron's own schedules (`get_forward_backward_func`): they own the whole step, forward, loss and
backward, through a loss function of theirs, while this engine's callers compute their losses from what the engine
returns; and they allocate on "cuda" by name. So a call runs the whole batch through the stages in turn (a stage
idles while the others work), except where the engine is handed every micro-batch's loss at once (sft's and the
ramp's LM loss, `forward_backward`; the RL update's and sampled OPD's, `logprob_losses`): `one_f_one_b` runs them in
Megatron's 1F1B order, so the stages work at once and each holds at most `pp` micro-batches' activations.

Every stage returns the same answer: the last stage computes it and broadcasts it over the pipeline group, so the
callers' SPMD loops (the same code on every rank) stay in step. `backward` then runs from the last stage back:
each stage receives the gradient of what it sent and sends the gradient of what it received."""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist


class StageDone(Exception):
    """Raised on a stage before the last once it has sent its hidden states on: the answer comes from the last."""


class Pipeline:
    """This rank's place in its pipeline group, and the tensors in flight since the last `backward`."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps  # megatron-core only after layout.cpu_patches (layout.py)
        self.size = ps.get_pipeline_model_parallel_world_size()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        if self.size > 1:
            self.prev, self.next = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
            self.group, self.src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.received: list[torch.Tensor] = []  # inputs from the previous stage, whose gradients go back to it
        self.sent: list[torch.Tensor] = []  # outputs to the next stage, whose gradients come back from it
        self.depth = 0
        self.pending: list | None = None  # under `one_f_one_b`: sends in flight (a stage never waits on its sends)

    def receive(self, shape: tuple, dtype: torch.dtype, device, grad: bool) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, self.prev)
        if grad:
            x.requires_grad_()
            self.received.append(x)
        return x

    def _send(self, t: torch.Tensor, peer: int) -> None:
        if self.pending is None:
            dist.send(t, peer)
            return
        kept = []  # a send the peer took lets its tensor go (a micro-batch's activations): not held to the end
        for req, sent in self.pending:
            if req.is_completed():
                req.wait()  # returns at once; raises what the send met
            else:
                kept.append((req, sent))
        self.pending = kept + [(dist.isend(t, peer), t)]

    def send(self, h: torch.Tensor, grad: bool) -> None:
        self._send(h.detach().contiguous(), self.next)
        if grad:
            self.sent.append(h)

    def backward(self, loss: torch.Tensor) -> None:
        """The last stage backpropagates `loss`; the others the gradients of what they sent (their `loss` is the
        last stage's, broadcast, with no graph here). In the order of the forwards on every stage."""
        if self.last:
            loss.backward()
        elif self.sent:
            grads = [torch.empty_like(h) for h in self.sent]
            for g in grads:
                dist.recv(g, self.next)
            torch.autograd.backward(self.sent, grads)
        if not self.first:
            for x in self.received:  # an input the loss did not reach still answers, with zeros
                self._send(x.grad if x.grad is not None else torch.zeros_like(x), self.prev)
        self.forget()

    def forget(self) -> None:
        self.received.clear()
        self.sent.clear()

    def share(self, result, device):
        """The last stage's `result` (a tensor or a tuple of them) on every stage."""
        if self.last:
            tensors = [result] if isinstance(result, torch.Tensor) else list(result or ())
            spec = [(isinstance(result, tuple), [(t.shape, t.dtype) for t in tensors])]
        else:
            spec = [None]
        dist.broadcast_object_list(spec, src=self.src, group=self.group, device=device)
        if isinstance(spec[0], str):
            raise RuntimeError(f"megatron: the last pipeline stage failed: {spec[0]}")
        is_tuple, shapes = spec[0]
        if not self.last:
            tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
        for t in tensors:
            dist.broadcast(t.detach().contiguous() if self.last else t, src=self.src, group=self.group)
        if self.last:
            return result
        return tuple(tensors) if is_tuple else tensors[0]

    def fail(self, error: BaseException, device) -> None:
        """The last stage's error, told to the others (else they would wait for its answer until the process group
        timed out): they raise it too."""
        dist.broadcast_object_list([repr(error)], src=self.src, group=self.group, device=device)


def one_f_one_b(pipe: Pipeline, forward: Callable[[int], torch.Tensor | None], m: int) -> torch.Tensor | None:
    """`m` micro-batches forward and backward in Megatron's 1F1B order (`forward_backward_pipelining_without_
    interleaving`): stage s runs pp - s - 1 forwards ahead, then alternates one forward and one backward, then drains.
    `forward(i)`: micro-batch i on this stage, the loss to backpropagate on the last (the others send on and return
    or raise StageDone). Sends go out without waiting, so a stage blocks only on what it receives, which its peer has
    sent or will send before it waits itself. Returns the last stage's summed losses (None on the others)."""
    warm = min(pipe.size - pipe.stage - 1, m)
    held, total = {}, None

    def run_forward(i: int) -> None:
        nonlocal total
        pipe.forget()
        try:
            loss = forward(i)
        except StageDone:
            loss = None
        if loss is not None:
            total = loss.detach() if total is None else total + loss.detach()
        held[i] = (list(pipe.received), list(pipe.sent), loss)

    def run_backward(i: int) -> None:
        received, sent, loss = held.pop(i)
        pipe.received[:], pipe.sent[:] = received, sent
        pipe.backward(loss)

    pipe.pending = []
    try:
        for i in range(warm):
            run_forward(i)
        for i in range(m - warm):
            run_forward(warm + i)
            run_backward(i)
        for i in range(m - warm, m):
            run_backward(i)
        for req, _ in pipe.pending:
            req.wait()
    finally:  # after a failure the peer may never take what was sent: raise rather than wait for it
        pipe.pending = None
    return total


def staged(method):
    """An engine method whose answer every pipeline stage returns (see the module). Nested calls (a staged method
    calling another) run as the outer one's part."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        pipe = self.pipe
        if pipe.size == 1 or pipe.depth:
            return method(self, *args, **kwargs)
        pipe.depth += 1
        try:
            out = method(self, *args, **kwargs)
        except StageDone:
            out = None
        except Exception as e:  # every stage takes part in the answer's broadcast, so that none is left waiting
            if pipe.last:
                pipe.fail(e, self.device)
            else:  # failed before its hidden states went on (an input every stage refuses): the last stage's word
                with contextlib.suppress(RuntimeError):
                    pipe.share(None, self.device)
            raise
        finally:
            pipe.depth -= 1
        return pipe.share(out, self.device)
    return run
