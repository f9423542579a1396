"""The megatron engine's config rules and options, read through posttrain.engines.registry. Light on purpose (the
config only: no torch, no megatron-core): the config checks a run with them before any work."""
from __future__ import annotations


def errors(cfg) -> list[str]:
    """runtime.train_engine megatron: what its engine refuses, said at load (a checkpoint's shapes are checked
    when the engine opens it, and before the first stage by posttrain.checkpoint_rules)."""
    m, g, errors = cfg.model, cfg.megatron, []
    ranks = g.tp * g.pp * g.cp * g.ep
    if not cfg.base.init_from:
        if m.arch == "glm5" and m.n_routed_experts % g.ep:
            errors.append(f"megatron.ep: must divide model.n_routed_experts {m.n_routed_experts} (got {g.ep})")
        if m.arch == "glm5" and g.tp > 1 and not g.sequence_parallel:
            errors.append("megatron.tp: Megatron splits a mixture-of-experts model (model.arch glm5) over "
                          "tensor-parallel ranks only with megatron.sequence_parallel, which needs Transformer "
                          "Engine; split its experts with megatron.ep instead")
        if m.arch != "glm5" and g.ep > 1:
            errors.append(f"megatron.ep: splits a mixture-of-experts model's experts (model.arch glm5); "
                          f"model.arch {m.arch} has none (supported: 1)")
        if m.num_layers % g.pp:
            errors.append(f"megatron.pp: must divide model.num_layers {m.num_layers} (got {g.pp})")
        kv = m.num_kv_heads or m.num_heads
        if m.arch != "glm5" and (m.num_heads % g.tp or kv % g.tp):
            errors.append(f"megatron.tp: must divide model.num_heads {m.num_heads} and the key-value heads {kv} "
                          f"(got {g.tp})")
    if cfg.sft.workers % ranks:
        errors.append(f"sft.workers: the megatron ranks of sft, a multiple of tp x pp x cp x ep = {ranks} "
                      f"(got {cfg.sft.workers})")
    if g.recompute and (cfg.rl.routing_replay or any(d.get("routing_replay") for d in cfg.rl.per_domain.values())):
        errors.append("rl.routing_replay: not with megatron.recompute (the recomputed forward would route by "
                      "itself); set one of them off")
    if g.sequence_parallel and max(g.cp, *(st.cp or 1 for st in cfg.ramp.stages)) > 1:
        errors.append("megatron.cp: with megatron.sequence_parallel needs Transformer Engine's attention, which "
                      "the engine does not drive yet; set one of them off (here or in ramp.stages)")
    if g.sequence_parallel and g.tp == 1:
        errors.append("megatron.sequence_parallel: needs megatron.tp > 1")
    return errors


def checkpoint_errors(cfg, hf, where: str) -> list[str]:
    """runtime.train_engine megatron: the engine's own checks of the split against the checkpoint (tp dividing the
    heads, pp the layers and GLM-5's shared-indexer groups, ep the routed experts, a model_type it maps, GLM-5's
    group routing), as each rung, sft, RL and OPD would meet them; the allowed values are the ones those checks
    pass."""
    # megatron-core and the models: only where a run asks for this engine
    from posttrain.engines.megatron import dsa as megatron_dsa, glm5 as megatron_glm5
    from posttrain.engines.megatron.layout import Parallel, check_layout
    from posttrain.checkpoint_rules import GLM5_TYPES
    from posttrain.models.glm5 import DENSE_TOPK
    g = cfg.megatron
    if cfg.ramp.attention == "dsa" and hf.model_type in GLM5_TYPES and getattr(hf, "index_topk", DENSE_TOPK) >= DENSE_TOPK:
        hf = type(hf).from_dict({**hf.to_dict(), "index_topk": cfg.ramp.dsa.top_k})  # as the ramp leaves it

    def problem(**change) -> str | None:
        par = Parallel(**{"tp": g.tp, "pp": g.pp, "cp": g.cp, "ep": g.ep, "sequence_parallel": g.sequence_parallel,
                          **change})
        try:
            check_layout(hf, par)
            if hf.model_type in megatron_glm5.MODEL_TYPES:
                megatron_dsa.check(hf, par, g.recompute)
        except ValueError as e:
            return str(e)
        return None

    err = problem()
    if err is None:
        return []
    key, _, rest = err.partition(": ")
    bound = {"megatron.tp": hf.num_attention_heads, "megatron.pp": hf.num_hidden_layers,
             "megatron.ep": getattr(hf, "n_routed_experts", None) or 1}.get(key)
    if bound and "supported" not in rest:
        field = key.split(".")[1]
        ok = [v for v in range(1, bound + 1) if not (problem(**{field: v}) or "").startswith(key)]
        rest += f"; allowed: {', '.join(map(str, ok))}"
    return [f"{key}: {where}: {rest}"]


def options(cfg) -> dict:
    """MegatronTrainEngine's keyword options from the config: its split over ranks."""
    from posttrain.engines.megatron.layout import Parallel  # megatron-core: only where the engine is built
    g = cfg.megatron
    return {"parallel": Parallel(g.tp, g.pp, g.cp, g.ep, g.sequence_parallel), "recompute": g.recompute,
            "distributed_optimizer": g.distributed_optimizer, "micro_batches": g.micro_batches}


def ranks(cfg, stage: str, cp: int | None = None) -> int:
    """The ranks a stage trains over: sft's Ray Train workers; a ramp rung's tp x pp x its cp (or megatron.cp) x
    ep; RL's and OPD's actors, tp x pp x cp x ep."""
    g = cfg.megatron
    if stage == "sft":
        return cfg.sft.workers
    return g.tp * g.pp * (cp or g.cp) * g.ep
