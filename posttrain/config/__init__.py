"""Typed pipeline configuration: YAML profiles under configs/, `--set a.b=c` overrides, a digest.

`common` (strict models, value ranges, error lines), the sections (`sections`: data, model, quantize, eval, gates,
runtime; `training`: base, ramp, sft, RL, OPD, LoRA, cross-stage) and `pipeline` (the whole config, the rules across
its sections, and how a profile loads)."""
from posttrain.config.common import MOVED, AtLeast0, AtLeast1, ConfigError, NonNegative, Positive, Share
from posttrain.config.pipeline import (PROFILES_DIR, ROOT, PipelineConfig, apply_overrides, config_from_dict, load_config,
                                       profile_path)
from posttrain.config.sections import (CurateConfig, EvalConfig, GatesConfig, MegatronConfig, ModelConfig,
                                       QuantizeConfig, RuntimeConfig, TokenizerConfig, TrackingConfig, WorldConfig)
from posttrain.config.training import (AlarmConfig, BaseConfig, CrossStageConfig, DSAConfig, JudgeConfig, LoraSettings,
                                       MoEConfig, MTPConfig, OPDConfig, RampConfig, RampStage, RLConfig, SFTConfig,
                                       TrainConfig)

__all__ = ["AlarmConfig", "AtLeast0", "AtLeast1", "BaseConfig", "ConfigError", "CrossStageConfig", "CurateConfig",
           "DSAConfig", "EvalConfig", "GatesConfig", "JudgeConfig", "LoraSettings", "MOVED", "MTPConfig",
           "MegatronConfig", "MoEConfig", "ModelConfig", "NonNegative", "OPDConfig", "PROFILES_DIR", "PipelineConfig",
           "Positive", "QuantizeConfig", "ROOT", "RLConfig", "RampConfig", "RampStage", "RuntimeConfig", "SFTConfig",
           "Share", "TokenizerConfig", "TrackingConfig", "TrainConfig", "WorldConfig", "apply_overrides",
           "config_from_dict", "load_config", "profile_path"]
