"""A process group of this process (rank 0) and SGLang servers (ranks 1..n), for broadcasting weights to them without
a file (SGLang's `/init_weights_update_group`, then `/update_weights_from_distributed`): a rollout worker and its own
server, or the trainer and every worker's server at once (runtime.weight_sync broadcast).

Not the default group: a trainer may hold one already (megatron's ranks, Ray Train's). torch.distributed makes
other groups only from the default one's world, so this builds one of its own through a TCP store, as SGLang's
server does on its side (`init_custom_process_group`); both run torch 2.13, whose private helper this calls."""
from __future__ import annotations

import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

TIMEOUT = timedelta(minutes=5)
Post = Callable[[dict], dict]  # sends a payload to one server's route, returns its answer


@dataclass
class WeightGroup:
    pg: object
    name: str
    device: torch.device


def _each(calls: list[Callable[[], dict]]) -> tuple[list[threading.Thread], list]:
    """Run the calls in threads (each blocks until its server has met this side in the group); their answers."""
    answers: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            answers[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 (reported with the others' answers)
            answers[i] = {"success": False, "message": f"{type(e).__name__}: {e}"}
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    return threads, answers


def _check(route: str, threads: list[threading.Thread], answers: list) -> None:
    for t in threads:
        t.join()
    bad = [f"server {i + 1}: {a}" for i, a in enumerate(answers) if not (a or {}).get("success", False)]
    if bad:
        raise RuntimeError(f"SGLang {route}: " + "; ".join(bad))


def weight_group(joins: list[Post], address: str = "127.0.0.1") -> WeightGroup:
    """Rendezvous with the servers: `joins[i](payload)` posts `/init_weights_update_group` to server i (rank i + 1;
    servers of one tensor-parallel rank each) and blocks until it has joined, so they run beside this side's own join.
    `address`: where the servers reach this process."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    name, world = f"posttrain-weights-{uuid.uuid4().hex[:8]}", 1 + len(joins)
    threads, answers = _each([lambda i=i: joins[i]({
        "master_address": address, "master_port": port, "rank_offset": 1 + i, "world_size": world,
        "group_name": name, "backend": backend}) for i in range(len(joins))])
    store, rank, world = next(rendezvous(f"tcp://{address}:{port}", 0, world, timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    pg, _ = _new_process_group_helper(world, rank, [], Backend(backend), PrefixStore(name, store), group_name=name,
                                      timeout=TIMEOUT)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}  # what collectives look ranks up in
    _check("init_weights_update_group", threads, answers)
    return WeightGroup(pg, name, torch.device("cuda" if cuda else "cpu"))


def send(group: WeightGroup, state: Mapping[str, torch.Tensor], receives: list[Post]) -> None:
    """Broadcast `state` from this process to every server of `group`: `receives[i](payload)` posts
    `/update_weights_from_distributed` (names, dtypes, shapes, group_name) to server i and returns once it has
    every tensor."""
    names = sorted(state)
    tensors = [state[n].detach().to(group.device).contiguous() for n in names]
    payload = {"names": names, "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
               "shapes": [list(t.shape) for t in tensors], "group_name": group.name}
    threads, answers = _each([lambda i=i: receives[i](payload) for i in range(len(receives))])
    for t in tensors:  # in the order the servers receive them
        dist.broadcast(t, src=0, group=group.pg)
    _check("update_weights_from_distributed", threads, answers)
