"""What every config section shares: strict models, the ranges a value is checked against, the error type."""
from __future__ import annotations

import re
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class ConfigError(ValueError):
    """A profile or override is wrong; the message names the key and the file."""


class _Strict(BaseModel):
    # inf and nan are refused where they are read ("sft.lr: must be a finite number"), not deep in a stage
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """pydantic takes `true` for 1: a number field given a boolean is a mistake, not a count."""
        if isinstance(v, bool):
            ann = cls.model_fields[info.field_name].annotation
            kinds = set(typing.get_args(ann)) if typing.get_origin(ann) in (typing.Union, types.UnionType) else {ann}
            if bool not in kinds and kinds & {int, float}:
                raise ValueError(f"must be a number (got {v!r})")
        return v


# Ranges, checked when a profile or override loads: a bad value fails before any stage runs, not in the stage
AtLeast0 = Annotated[int, Field(ge=0)]
AtLeast1 = Annotated[int, Field(ge=1)]
Share = Annotated[float, Field(ge=0, le=1)]
Positive = Annotated[float, Field(gt=0)]      # learning rates, sampling temperatures (the loss divides by them)
NonNegative = Annotated[float, Field(ge=0)]


def _given(section: Any, key: str, default: Any) -> Any:
    """A key of a section as given to the validators: a raw mapping or a built section."""
    return section.get(key, default) if isinstance(section, dict) else getattr(section, key, default)


MOVED = {"rl.train_engine": "runtime.train_engine", "rl.rollout_engine": "runtime.rollout_engine"}
_RULES = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _error_line(e: dict, prefix: str = "") -> str:
    """One pydantic error as `key: rule (got value)`."""
    key = prefix + ".".join(str(x) for x in e["loc"])
    if e["type"] == "extra_forbidden":
        return f"{key}: moved to {MOVED[key]}" if key in MOVED else f"{key}: unknown key"
    if e["type"] == "value_error":  # a validator's own message; ours start with their key path and say what they got
        msg = e["msg"].removeprefix("Value error, ")
        if msg.startswith(key):
            return msg
        return f"{key}.{msg}" if key and re.match(r"[a-z_]+: ", msg) else f"{key}: {msg}"
    if e["type"] == "finite_number":
        return f"{key}: must be a finite number (got {e.get('input')!r})"
    rule, bound = _RULES.get(e["type"]), next(iter(e.get("ctx", {}).values()), None)
    msg = f"must be {rule} {f'{bound:g}' if isinstance(bound, float) else bound}" if rule else e["msg"]
    return f"{key}: {msg} (got {e.get('input')!r})"
