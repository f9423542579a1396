"""The whole pipeline's config: YAML profiles under configs/, `--set a.b=c` overrides, a digest."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from posttrain.config.common import ConfigError, _error_line, _given, _Strict
from posttrain.config.sections import (CurateConfig, EvalConfig, GatesConfig, MegatronConfig, ModelConfig,
                                       QuantizeConfig, RuntimeConfig, TokenizerConfig, TrackingConfig, WorldConfig)
from posttrain.config.training import (BaseConfig, CrossStageConfig, DSAConfig, LoraSettings, MoEConfig, MTPConfig,
                                       OPDConfig, RampConfig, RampStage, RLConfig, SFTConfig)
from posttrain.engines import registry

ROOT = Path(__file__).resolve().parents[2]
PROFILES_DIR = ROOT / "configs"


class PipelineConfig(_Strict):
    profile: str = "tiny"
    seed: Annotated[int, Field(ge=0, lt=2**32)] = 0  # numpy's seed range (seed_all)
    world: WorldConfig = WorldConfig()
    curate: CurateConfig = CurateConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    model: ModelConfig = ModelConfig()
    base: BaseConfig = BaseConfig()
    ramp: RampConfig = RampConfig()
    mtp: MTPConfig = MTPConfig()
    moe: MoEConfig = MoEConfig()
    sft: SFTConfig = SFTConfig()
    rl: RLConfig = RLConfig()
    opd: OPDConfig = OPDConfig()
    lora: LoraSettings = LoraSettings()
    cross_stage: CrossStageConfig = CrossStageConfig()
    quantize: QuantizeConfig = QuantizeConfig()
    eval: EvalConfig = EvalConfig()
    gates: GatesConfig = GatesConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    megatron: MegatronConfig = MegatronConfig()
    tracking: TrackingConfig = TrackingConfig()
    registered_model: str = "posttrain-tiny"

    @field_validator("registered_model")
    @classmethod
    def _registry_name(cls, v: str) -> str:
        """MLflow refuses '/' and ':' only after the whole DAG trained; `posttrain lineage NAME@VERSION` needs no @."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", v):
            raise ValueError(f"must be 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit "
                             f"(got {v!r})")
        return v

    @model_validator(mode="before")
    @classmethod
    def _glm5_attention(cls, data: Any) -> Any:
        """ramp.attention left unset with GLM-5 (model.arch glm5, or base.init_from a local GLM-5 checkpoint, whose
        config.json's model_type is read): sdpa instead of the dense default packed_sdpa. Unset means absent from
        what was given (for a section given built, not in its `model_fields_set`); a run's saved config, reloaded,
        has it written out. A `checkpoint:<name>` or a remote path is read once the CLI has resolved it locally."""
        if not isinstance(data, dict):
            return data
        ramp = data.get("ramp", {})
        given = ramp.model_fields_set if isinstance(ramp, RampConfig) else ramp if isinstance(ramp, dict) else None
        if given is None or "attention" in given:
            return data
        init_from = _given(data.get("base", {}), "init_from", "")
        if init_from and isinstance(init_from, str):
            try:  # config.json read here, not through checkpoint_rules: the config's code closure stays small
                glm5 = json.loads((Path(init_from) / "config.json").read_text()).get("model_type") in (
                    "glm_moe_dsa", "deepseek_v32")
            except (OSError, ValueError, AttributeError):
                glm5 = False
        else:
            glm5 = _given(data.get("model", {}), "arch", "llama") == "glm5"
        if not glm5:
            return data
        ramp = ramp.model_copy(update={"attention": "sdpa"}) if isinstance(ramp, RampConfig) else \
            {**ramp, "attention": "sdpa"}
        return {**data, "ramp": ramp}
    @model_validator(mode="after")
    def _consistent(self) -> "PipelineConfig":
        """Rules across sections (`cross_section_errors`); each message starts with the key to change."""
        if errors := cross_section_errors(self):
            raise ValueError("\n  ".join(errors))
        return self

    def section(self, name: str) -> Any:
        """A section ("eval"), a key path ("eval.batch_size") or one specialist's RL settings ("rl:agentic":
        `rl` with that domain's overrides applied and no other domain's, so a change to one specialist's
        settings, or a new domain, leaves the others' cache keys alone)."""
        if name.startswith("rl:"):
            return self.rl.for_domain(name[3:]).model_dump(mode="json", exclude={"domains", "per_domain"})
        return _at(self.model_dump(mode="json"), name)

    def digest(self, *sections: str) -> str:
        """sha256 of the whole config, or of only the named sections (see `section`)."""
        data = self.model_dump(mode="json")
        if sections:
            data = {k: self.section(k) for k in sections}
        else:
            data.pop("runtime")  # where it runs and where it is tracked do not change what it computes
            data.pop("tracking")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def ramp_ranks(self, stage: RampStage) -> int:
        """The ranks a ramp rung trains over (the train engine's layout, posttrain.engines.registry)."""
        return registry.ranks(self, "ramp", stage.cp)

    def sft_in_process(self) -> bool:
        """sft's one rank trains in its stage's own Ray worker; more ranks are Ray Train workers, and the stage's task
        only waits on them; so are an engine's whose ranks save their own shards of the resume state (Ray Train
        gathers them into one checkpoint)."""
        return registry.ranks(self, "sft") == 1 and \
            not registry.supports("train", self.runtime.train_engine, registry.SHARDED_STATE)

    def eval_lengths(self) -> list[int]:
        """Every ramp stage's length and the tiny preset's own context length: long_context is scored at each.
        A checkpoint's (base.init_from) own length can be far longer than the ladder it is given here."""
        own = () if self.base.init_from else (self.model.max_position_embeddings,)
        return sorted({*own, *(s.seq_len for s in self.ramp.stages)})


# --- rules across sections, said at load so that a run does not fail stages later

def cross_section_errors(cfg: PipelineConfig) -> list[str]:
    """Rules across sections, checked at load so a run does not fail stages later. Each message starts with
    the key to change."""
    m, errors = cfg.model, []
    known = {"sft", *(f"specialist/{d}" for d in cfg.rl.domains), "generalist", "quantized"}
    if unknown := [c for c in cfg.eval.samples_on if c not in known]:
        errors.append(f"eval.samples_on: {unknown} are not chat-scored checkpoints (those are {sorted(known)})")
    if cfg.base.chat_template and not cfg.base.init_from:
        errors.append("base.chat_template: replaces a checkpoint's template, so it needs base.init_from (the "
                      "tiny preset's own template renders every feature)")
    if not cfg.base.init_from:  # the model is built from `model` (a checkpoint brings its own shapes)
        if cfg.base.seq_len > m.max_position_embeddings:
            errors.append(f"base.seq_len: must be <= model.max_position_embeddings (got {cfg.base.seq_len} > "
                          f"{m.max_position_embeddings}); longer contexts are the ramp's")
        # quantize.targets refuses it only after every stage trained: the MLP's inputs are
        # hidden_size (gate, up) and intermediate_size (down) columns wide
        g = cfg.quantize.group_size
        if m.hidden_size % g or m.intermediate_size % g:
            errors.append(f"quantize.group_size: must divide model.hidden_size and model.intermediate_size "
                          f"(got {g} for {m.hidden_size} and {m.intermediate_size})")
        elif m.arch == "glm5" and m.moe_intermediate_size % g:  # an expert's down projection's inputs
            errors.append(f"quantize.group_size: must divide model.moe_intermediate_size "
                          f"(got {g} for {m.moe_intermediate_size})")
        if m.arch == "glm5" and cfg.ramp.attention not in ("sdpa", "eager", "dsa"):
            errors.append(f"ramp.attention: must be sdpa, eager or dsa with model.arch glm5 (got "
                          f"{cfg.ramp.attention!r}): GLM-5 brings its own DSA indexer, which reads the full "
                          f"mask only those build")
        # against the defaults, not `model_fields_set`: a run's saved config, reloaded, sets every field
        mine = {k for k in ("index_share", "heads", "own_indexer")
                if getattr(cfg.ramp.dsa, k) != DSAConfig().model_dump()[k]}
        if m.arch == "glm5" and cfg.ramp.attention == "dsa" and mine:
            errors.append(f"ramp.dsa.{sorted(mine)[0]}: GLM-5's own indexers are laid out by model.indexer_types "
                          f"(full / shared per layer), not by ramp.dsa's {', '.join(sorted(mine))}; drop them")
        if m.arch != "glm5" and (cfg.rl.routing_replay or any(d.get("routing_replay")
                                                              for d in cfg.rl.per_domain.values())):
            errors.append(f"rl.routing_replay: needs a mixture-of-experts policy (model.arch glm5, or a "
                          f"base.init_from checkpoint with routers); model.arch {m.arch} is dense")
        if cfg.ramp.attention == "dsa" and m.arch != "glm5" and \
                any(i >= m.num_layers for i in cfg.ramp.dsa.own_indexer):
            errors.append(f"ramp.dsa.own_indexer: layers must be < model.num_layers {m.num_layers} "
                          f"(got {cfg.ramp.dsa.own_indexer})")
    errors += engine_errors(cfg)
    partial = {d: r for d in ["", *cfg.rl.per_domain] if (r := cfg.rl.for_domain(d)).partial_rollouts
               and (not d or {"partial_rollouts", "max_staleness"} & set(cfg.rl.per_domain[d]))}
    w4a8 = [f"rl.per_domain.{d}" if d else "rl" for d in ["", *cfg.rl.per_domain]
            if cfg.rl.for_domain(d).rollout_dtype == "w4a8"]
    for needed, capability, why in (
            (cfg.runtime.weight_sync == "broadcast", registry.WEIGHT_BROADCAST,
             "runtime.weight_sync: broadcast needs a rollout engine that joins the trainer's process group"),
            (w4a8, registry.INT_KERNELS, f"{(w4a8 or ['rl'])[0]}.rollout_dtype: w4a8 runs on posttrain's integer "
                                         f"kernels"),
            (partial, registry.PARTIAL_ROLLOUTS, "rl.partial_rollouts: needs a rollout engine that takes weights "
                                                 "mid-generation")):
        if needed and engine_known(cfg, "rollout") and \
                not registry.supports("rollout", cfg.runtime.rollout_engine, capability):
            errors.append(f"{why} ({registry.names('rollout', capability)}; got runtime.rollout_engine "
                          f"{cfg.runtime.rollout_engine!r})")
    for d, r in partial.items():
        if r.max_staleness < 1:
            key = f"rl.per_domain.{d}" if d else "rl"
            errors.append(f"{key}.partial_rollouts: needs {key}.max_staleness >= 1 (at 0 nothing generates "
                          f"across an update)")
    # the ramp extends the context: each stage sets max_position_embeddings to its seq_len
    first = cfg.ramp.stages[0].seq_len
    if first < m.max_position_embeddings and not cfg.base.init_from:
        errors.append(f"ramp.stages.0.seq_len: must be >= model.max_position_embeddings "
                      f"(got {first} < {m.max_position_embeddings})")
    domains = cfg.rl.domains
    if cfg.opd.student not in ("sft", *(f"rl-{d}" for d in domains)):
        errors.append(f"opd.student: must be sft or a specialist rl-<domain> of rl.domains {domains} "
                      f"(got {cfg.opd.student!r})")
    for key, teacher in cfg.opd.route.items():
        if key not in domains or teacher not in (*domains, "base"):
            errors.append(f"opd.route.{key}: prompts are domains of rl.domains {domains}, teachers those or "
                          f"base (got {key} -> {teacher})")
    if cfg.opd.kl_coef and cfg.opd.loss != "sampled":
        errors.append(f"opd.kl_coef: the reference KL is estimated on the sampled tokens, so it needs opd.loss "
                      f"sampled (got {cfg.opd.loss})")
    # RLConfig also carries the OPD loop (no RL prompts) and unit tests (lr 0); an rl stage needs both
    for d in ["", *cfg.rl.per_domain]:
        r, key = (cfg.rl.for_domain(d), f"rl.per_domain.{d}") if d else (cfg.rl, "rl")
        for name, ok, rule in (("lr", r.lr > 0, "> 0"), ("prompts_per_step", r.prompts_per_step >= 1, ">= 1")):
            if not ok and (not d or name in cfg.rl.per_domain[d]):
                errors.append(f"{key}.{name}: must be {rule} (got {getattr(r, name)!r})")
    return errors


def engine_known(cfg: PipelineConfig, kind: str) -> bool:
    try:
        registry.spec(kind, getattr(cfg.runtime, f"{kind}_engine"))
        return True
    except ValueError:
        return False

def engine_errors(cfg: PipelineConfig) -> list[str]:
    """What the train engine cannot do (its declared capabilities, posttrain.engines.registry), and its own rules
    over its config section, said at load (a checkpoint's shapes are checked when the engine opens it)."""
    errors = []
    for kind in ("train", "rollout"):
        try:
            registry.spec(kind, getattr(cfg.runtime, f"{kind}_engine"))
        except ValueError as e:
            errors.append(str(e))
    if not engine_known(cfg, "train"):
        return errors
    name, m = cfg.runtime.train_engine, cfg.model

    def lacks(capability: str) -> bool:
        return not registry.supports("train", name, capability)
    if lacks(registry.CONTEXT_PARALLEL):
        errors += [f"ramp.stages.{i}.cp: context parallelism needs a train engine that splits sequences over "
                   f"ranks ({registry.names('train', registry.CONTEXT_PARALLEL)}; got runtime.train_engine "
                   f"{name!r}) or drop it (got {st.cp})" for i, st in enumerate(cfg.ramp.stages) if st.cp not in (None, 1)]
    if lacks(registry.OWN_INDEXERS) and cfg.ramp.attention == "dsa" and m.arch != "glm5" and not cfg.base.init_from:
        errors.append(f"ramp.attention: dsa on a dense model adds posttrain's own indexers, which the {name} engine "
                      f"does not train ({registry.names('train', registry.OWN_INDEXERS)} do; it trains GLM-5's, "
                      f"model.arch glm5). Use sdpa, packed_sdpa or flash_attention_2 with runtime.train_engine {name}")
    if lacks(registry.ROPE_SCALING):
        errors += [f"ramp.stages.{i}.rope_scaling: the {name} engine runs default RoPE (a stage's rope_theta) only; "
                   f"drop it or use runtime.train_engine {registry.names('train', registry.ROPE_SCALING)} (got "
                   f"{st.rope_scaling})" for i, st in enumerate(cfg.ramp.stages) if st.rope_scaling]
    if cfg.rl.routing_replay or any(d.get("routing_replay") for d in cfg.rl.per_domain.values()):
        rollout = cfg.runtime.rollout_engine
        if lacks(registry.ROUTING_REPLAY):
            errors.append(f"rl.routing_replay: the {name} train engine cannot score through recorded routes "
                          f"({registry.names('train', registry.ROUTING_REPLAY)} can)")
        if engine_known(cfg, "rollout") and not registry.supports("rollout", rollout, registry.ROUTING_RECORD):
            errors.append(f"rl.routing_replay: the {rollout} rollout engine does not record expert routes "
                          f"({registry.names('rollout', registry.ROUTING_RECORD)} does; got runtime.rollout_engine "
                          f"{rollout!r})")
    if cfg.lora.rank and lacks(registry.LORA):
        errors.append(f"lora.rank: the {name} train engine trains no LoRA adapters "
                      f"({registry.names('train', registry.LORA)} does); set lora.rank 0 or change runtime.train_engine")
    if rules := registry.rules(name):
        errors += rules(cfg)
    return errors


# --- loading: a profile, its overrides, and errors that name the key and the file

def _at(data: dict, path: str) -> Any:
    for part in path.split("."):
        data = data[part]
    return data


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict, overrides: list[str], source: str = "--set") -> dict:
    data = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source}: override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            if not isinstance(node.setdefault(p, {}), dict):
                raise ConfigError(f"{source}: {key!r}: {p!r} is not a section")
            node = node[p]
        node[parts[-1]] = _parse_value(raw)
    return data


def _is_branch(part: Any) -> bool:
    """A union member's tag in an error's location (`constrained-float`, `dict[str,constrained-float]`)."""
    return isinstance(part, str) and ("[" in part or part.startswith("constrained-"))


def _without_branches(errors: list[dict]) -> list[dict]:
    """A value of a union type (a share, or domain -> share) fails each branch; keep the branch the value
    was meant for: the errors that are not 'wrong type' when there are any."""
    out = []
    for e in errors:
        loc = tuple(p for p in e["loc"] if not _is_branch(p))
        wrong_type = e["type"].endswith(("_type", "_parsing"))
        branched = loc != tuple(e["loc"])
        siblings = [x for x in errors if x is not e and tuple(p for p in x["loc"] if not _is_branch(p))[:len(loc)] == loc]
        if branched and wrong_type and any(not x["type"].endswith(("_type", "_parsing")) for x in siblings):
            continue
        out.append({**e, "loc": loc})
    return out


def _format_validation(err: ValidationError, source: str) -> str:
    return "\n".join([f"invalid config in {source}:",
                       *(f"  {_error_line(e)}" for e in _without_branches(err.errors()))])


def profile_path(profile: str) -> Path:
    """A profile name (configs/<name>.yaml) or a path to a YAML file."""
    p = Path(profile)
    if p.suffix in (".yaml", ".yml") or "/" in profile or p.is_dir():  # meant as a path
        if p.is_dir():
            raise ConfigError(f"--profile {profile}: is a directory; expected a YAML file or a profile name")
        if not p.is_file():
            raise ConfigError(f"--profile {profile}: no such file")
        return p
    path = PROFILES_DIR / f"{profile}.yaml"
    if not path.exists():
        known = sorted(x.stem for x in PROFILES_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown profile {profile!r}: no file {path} (known: {', '.join(known)})")
    return path


def load_config(profile: str = "tiny", overrides: list[str] | None = None) -> PipelineConfig:
    path = profile_path(profile)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    data.setdefault("profile", path.stem)
    try:
        PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, str(path))) from None
    return config_from_dict(apply_overrides(data, overrides or []), f"{path} with --set {overrides}")


def config_from_dict(data: dict, source: str = "config") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None
