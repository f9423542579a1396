"""A process group of two, this process (rank 0) and an SGLang server (rank 1), for broadcasting weights to it
without a file (SGLang's `/init_weights_update_group`, then `/update_weights_from_distributed`).

Not the default group: a trainer may hold one already (megatron's ranks, Ray Train's). torch.distributed makes
other groups only from the default one's world, so this builds one of its own through a TCP store, as SGLang's
server does on its side (`init_custom_process_group`); both run torch 2.13, whose private helper this calls."""
from __future__ import annotations

import socket
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch

TIMEOUT = timedelta(minutes=5)


@dataclass
class WeightGroup:
    pg: object
    name: str
    device: torch.device


def weight_group(init_server) -> WeightGroup:
    """Rendezvous with the server: `init_server(payload)` posts `/init_weights_update_group` (it blocks until the
    server has joined, so it runs beside this side's own join)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = f"posttrain-weights-{uuid.uuid4().hex[:8]}"
    answer: list = []
    server = threading.Thread(target=lambda: answer.append(init_server({
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": name,
        "backend": backend})))
    server.start()
    store, rank, world = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=TIMEOUT))
    store.set_timeout(TIMEOUT)
    pg, _ = _new_process_group_helper(world, rank, [], Backend(backend), PrefixStore(name, store), group_name=name,
                                      timeout=TIMEOUT)
    _world.pg_group_ranks[pg] = {i: i for i in range(world)}  # what collectives look ranks up in
    server.join()
    if not answer or not answer[0].get("success", False):
        raise RuntimeError(f"SGLang init_weights_update_group: {answer[0] if answer else 'no answer'}")
    return WeightGroup(pg, name, torch.device("cuda" if cuda else "cpu"))
