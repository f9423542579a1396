"""Routing replay for RL on mixture-of-experts policies (R3: "rollout routing replay"): the experts the rollout
engine chose for every token travel with the sample, and the trainer forces them in its forward, so a token the
trainer's router would send elsewhere (other numerics, newer weights under asynchronous staleness) is scored
through the experts that really produced it. `rl.routing_replay: true` turns it on.

A sample's routes are one int16 tensor [routers, positions, k]: position t is the token at t of prompt + ids, for
every position the rollout ran through the model (the last generated token never is). In a multi-turn episode the
routes are the last turn's, whose prefill re-ran the earlier turns and the tool outputs (R3 keeps the same per
request); positions without a route (-1) are left to the router.

The hooks themselves are posttrain.models.moe.RouterHooks (record / replay_calls); here is where the routes of a batched
rollout are cut into samples and laid out again for the trainer's prefix forward (posttrain.models.prefix)."""
from __future__ import annotations

import torch

ROUTE_DTYPE = torch.int16   # expert ids (GLM-5: 256 experts) and -1 for "no route"


class RolloutRoutes:
    """The routes of one batched generation (posttrain.engines.torch_rollout.sample): the prefill of the distinct
    prompts, then one token per live row per decoding step, cut into each row's routes at the end."""

    def __init__(self, prefill: torch.Tensor, prompts: list[list[int]], which: torch.Tensor):
        n_routers, _, k = prefill.shape
        width = max(map(len, prompts))
        per_prompt = prefill.view(n_routers, -1, width, k).to("cpu", ROUTE_DTYPE)
        self._rows = [[per_prompt[:, u, width - len(p):]] for p, u in zip(prompts, which.tolist())]

    def step(self, routes: torch.Tensor, rows: list[int], stopped: list[bool]) -> None:
        """A decoding forward's routes [routers, len(rows), k]: batch row i fed the last token of prompt rows[i]."""
        routes = routes.to("cpu", ROUTE_DTYPE)
        for i, r in enumerate(rows):
            if not stopped[r]:  # a stopped row was fed padding
                self._rows[r].append(routes[:, i:i + 1])

    def row(self, r: int) -> torch.Tensor:
        return torch.cat(self._rows[r], 1)


def check_routes(samples: list, n_routers: int) -> int:
    """The experts per token of the samples' routes; refused when none has routes or their shapes do not fit a
    policy with `n_routers` routers."""
    have = [s.routes for s in samples if getattr(s, "routes", None) is not None]
    if not have:
        raise ValueError("routing replay: no sample carries routes (the rollout engine did not record them)")
    k = have[0].shape[-1]
    for r in have:
        if r.dim() != 3 or r.shape[0] != n_routers or r.shape[-1] != k:
            raise ValueError(f"routing replay: routes of shape {tuple(r.shape)} for a policy with {n_routers} "
                             f"routers choosing {k} experts each")
    return k


def prefix_calls(samples: list, n_routers: int) -> list[list[torch.Tensor]]:
    """The samples' routes laid out as posttrain.models.prefix.prefix_forward runs them: the distinct prompts
    left-padded (its prefill), then every completion right-padded (its continuation); one [N, k] tensor per router
    and forward, -1 where a position has no route (padding, the last token, a sample without routes)."""
    k = check_routes(samples, n_routers)
    first: dict[tuple[int, ...], object] = {}
    for s in samples:  # in prefill_distinct's order
        first.setdefault(tuple(s.prompt_ids), s)
    width = max(map(len, first))
    pre = torch.full((n_routers, len(first), width, k), -1, dtype=torch.long)
    for u, (p, s) in enumerate(first.items()):
        if getattr(s, "routes", None) is not None:
            n = min(len(p), s.routes.shape[1])
            pre[:, u, width - len(p):width - len(p) + n] = s.routes[:, :n]
    longest = max(1, max(len(s.ids) for s in samples))
    tail = torch.full((n_routers, len(samples), longest, k), -1, dtype=torch.long)
    for b, s in enumerate(samples):
        if getattr(s, "routes", None) is not None:
            got = s.routes[:, len(s.prompt_ids):len(s.prompt_ids) + len(s.ids)]
            tail[:, b, :got.shape[1]] = got
    return [list(pre.flatten(1, 2)), list(tail.flatten(1, 2))]
