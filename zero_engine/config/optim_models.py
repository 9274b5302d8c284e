"""The `optimizer` and `scheduler` sections.

Their `params` differ by `type`, so each type has its own params model: the loader checks the keys of `params`
against it (typos get a did-you-mean), and the validated section stores plain dicts the engine passes on.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from zero_engine.config.fields import (
    CONFIG_ERROR_TYPE,
    Auto,
    ConfigBool,
    ConfigFloat,
    ConfigInt,
    NotSupported,
    Section,
    closest_key,
    show,
)
from zero_engine.config.notes import LoadNotes
from zero_engine.errors import ConfigError

_OPTIMIZER_DEFAULT = Auto("removed, so the optimizer's own default applies")

NonNegativeFloat = Annotated[ConfigFloat, Field(ge=0)]


class AdamParams(Section):
    """`optimizer.params` for Adam and AdamW. Absent keys take the optimizer's own defaults
    (torch: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0 for Adam and 1e-2 for AdamW)."""

    lr: Annotated[NonNegativeFloat | None, _OPTIMIZER_DEFAULT] = Field(None, description="Learning rate.")
    betas: Annotated[tuple[ConfigFloat, ConfigFloat] | None, _OPTIMIZER_DEFAULT] = Field(
        None, description="Decay rates of the first and second moment estimates."
    )
    eps: Annotated[NonNegativeFloat | None, _OPTIMIZER_DEFAULT] = Field(None, description="Denominator epsilon.")
    weight_decay: Annotated[NonNegativeFloat | None, _OPTIMIZER_DEFAULT] = Field(
        None, description="Weight decay; decoupled (AdamW-style) when adam_w_mode is true."
    )
    torch_adam: ConfigBool = Field(False, description="Use torch.optim's implementation instead of a fused one.")
    adam_w_mode: ConfigBool = Field(
        True,
        description="Decoupled weight decay. DeepSpeed's default is true even for type Adam; AdamW always uses it.",
    )

    not_supported = {
        "bias_correction": NotSupported(True, "Adam without bias correction"),
        "amsgrad": NotSupported(False, "AMSGrad"),
    }


class SgdParams(Section):
    """`optimizer.params` for SGD (torch.optim.SGD). Absent keys take torch's defaults."""

    lr: Annotated[NonNegativeFloat | None, _OPTIMIZER_DEFAULT] = Field(None, description="Learning rate.")
    momentum: NonNegativeFloat | None = Field(None, description="Momentum factor.")
    dampening: NonNegativeFloat | None = Field(None, description="Dampening for momentum.")
    weight_decay: Annotated[NonNegativeFloat | None, _OPTIMIZER_DEFAULT] = Field(None, description="L2 penalty.")
    nesterov: ConfigBool | None = Field(None, description="Nesterov momentum.")


OPTIMIZER_PARAMS: dict[str, type[Section]] = {"adam": AdamParams, "adamw": AdamParams, "sgd": SgdParams}
SUPPORTED_OPTIMIZERS = "Adam, AdamW, SGD"


def nested_error(exc: ValidationError, subpath: str) -> PydanticCustomError:
    """Re-raise a nested model's first error inside an outer validator, keeping the key path."""
    first = exc.errors(include_url=False)[0]
    ctx = first.get("ctx") or {}
    loc = ".".join([str(part) for part in first["loc"]] + ([ctx["subpath"]] if ctx.get("subpath") else []))
    where = f"{subpath}.{loc}" if loc else subpath
    if first["type"] == CONFIG_ERROR_TYPE and "detail" in ctx:
        detail = ctx["detail"]
    elif first["type"] == "missing":
        detail = "required key is missing"
    elif first["type"] == "extra_forbidden":
        detail = "unknown key"
    else:
        detail = f"invalid value {show(first['input'])}: {first['msg'][:1].lower()}{first['msg'][1:]}"
    return PydanticCustomError(CONFIG_ERROR_TYPE, "{detail}", {"detail": detail, "subpath": where})


def optimizer_type_problem(type_name: Any) -> str | None:
    """Why `type_name` cannot be used, or None when it is supported."""
    if not isinstance(type_name, str):
        return f'invalid value {show(type_name)}: expected a string such as "AdamW"'
    if type_name.lower() in OPTIMIZER_PARAMS:
        return None
    near = closest_key(type_name.lower(), list(OPTIMIZER_PARAMS), cutoff=0.8)
    if near is not None:
        return f"unknown optimizer type {show(type_name)}; did you mean {near}?"
    return f"{show(type_name)} is not supported yet; supported: {SUPPORTED_OPTIMIZERS}"


def _params_model(table: dict[str, type[Section]], type_name: str | None) -> dict[str, type[Section]]:
    """The model that validates ``params`` for this ``type`` (optimizer and scheduler sections alike)."""
    params_model = table.get(type_name) if type_name is not None else None
    return {"params": params_model} if params_model is not None else {}


def _check_type(raw: dict[str, Any], path: str, notes: LoadNotes, type_problem) -> dict[str, Any]:
    """A ``type`` we lack is noted as "not supported yet"; any other bad ``type`` is an error right away."""
    problem = type_problem(raw.get("type")) if "type" in raw else None
    if problem is not None:
        message = f"{path}.type: {problem}"
        if "not supported yet" not in problem:
            raise ConfigError(message)
        notes.not_supported(message)
    return raw


class OptimizerConfig(Section):
    """The optimizer zero_engine builds when `initialize` gets no optimizer object."""

    type: Literal["adam", "adamw", "sgd"] = Field(
        description="Optimizer, case-insensitive: Adam, AdamW or SGD (normalised to lower case)."
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the optimizer, only those the config gave."
    )
    torch_adam: ConfigBool = Field(False, description="Read from params.torch_adam.")
    adam_w_mode: ConfigBool = Field(True, description="Read from params.adam_w_mode; always true for AdamW.")

    not_supported = {"legacy_fusion": NotSupported(False, "legacy fused optimizer")}
    derived_fields = frozenset({"torch_adam", "adam_w_mode"})

    @classmethod
    def subsection_models(cls, raw: dict[str, Any]) -> dict[str, type[Section]]:
        type_name = raw.get("type")
        return _params_model(OPTIMIZER_PARAMS, type_name.lower() if isinstance(type_name, str) else None)

    @classmethod
    def prepare(cls, raw: dict[str, Any], path: str, notes: LoadNotes) -> dict[str, Any]:
        return _check_type(raw, path, notes, optimizer_type_problem)

    @model_validator(mode="before")
    @classmethod
    def _split_params(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "type" not in data:
            return data
        problem = optimizer_type_problem(data["type"])
        if problem is not None:
            raise PydanticCustomError(CONFIG_ERROR_TYPE, "{detail}", {"detail": problem, "subpath": "type"})
        type_name = data["type"].lower()
        params = data.get("params", {})
        if not isinstance(params, dict):
            raise PydanticCustomError(
                CONFIG_ERROR_TYPE, "{detail}",
                {"detail": f"invalid value {show(params)}: expected an object", "subpath": "params"},
            )
        try:
            validated = OPTIMIZER_PARAMS[type_name].model_validate(params)
        except ValidationError as exc:
            raise nested_error(exc, "params") from None
        given = validated.model_dump(exclude_unset=True)
        torch_adam = given.pop("torch_adam", False)
        adam_w_mode = given.pop("adam_w_mode", True)
        if type_name == "adamw" and not adam_w_mode:
            raise PydanticCustomError(
                CONFIG_ERROR_TYPE, "{detail}",
                {"detail": "false contradicts type AdamW; use type Adam for L2-style weight decay",
                 "subpath": "params.adam_w_mode"},
            )
        return {**data, "type": type_name, "params": given, "torch_adam": torch_adam, "adam_w_mode": adam_w_mode}


# --- scheduler -------------------------------------------------------------------------------------------------

_WARMUP_MIN_LR = Auto("0 (as Hugging Face's Trainer)")
_WARMUP_MAX_LR = Auto("optimizer.params.lr when the config gives it, else null: the built optimizer's lr")
_WARMUP_NUM_STEPS = Auto("1 (Hugging Face's default is no warmup; DeepSpeed's shortest is 1, run as 2 steps)")
_TOTAL_NUM_STEPS = Auto("left open: pass total_num_steps to SchedulerConfig.resolved_params (HF uses max_steps)")

WarmupType = Literal["log", "linear"]


class WarmupLRParams(Section):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    warmup_min_lr: Annotated[NonNegativeFloat, _WARMUP_MIN_LR] = Field(0.0, description="Learning rate at step 0.")
    warmup_max_lr: Annotated[NonNegativeFloat | None, _WARMUP_MAX_LR] = Field(
        None, description="Learning rate after warmup; null: the optimizer's lr (current DeepSpeed)."
    )
    warmup_num_steps: Annotated[ConfigInt, _WARMUP_NUM_STEPS] = Field(1000, ge=0, description="Warmup length.")
    warmup_type: WarmupType = Field("log", description="Warmup curve.")
    last_batch_iteration: ConfigInt = Field(-1, ge=-1, description="Step to resume from; -1 starts fresh.")


class WarmupDecayLRParams(WarmupLRParams):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: Annotated[ConfigInt | None, _TOTAL_NUM_STEPS] = Field(
        ge=1, description="Total optimizer steps of the run (required)."
    )
    warmup_max_lr: Annotated[NonNegativeFloat | None, _WARMUP_MAX_LR] = Field(
        0.001, description="Learning rate after warmup."
    )


class WarmupCosineLRParams(Section):
    """Warm up a ratio of the optimizer's lr from warmup_min_ratio to 1, then cosine-decay to cos_min_ratio."""

    total_num_steps: Annotated[ConfigInt | None, _TOTAL_NUM_STEPS] = Field(
        ge=1, description="Total optimizer steps of the run (required)."
    )
    warmup_min_ratio: NonNegativeFloat = Field(0.0, description="lr ratio at step 0.")
    warmup_num_steps: Annotated[ConfigInt, _WARMUP_NUM_STEPS] = Field(1000, ge=0, description="Warmup length.")
    cos_min_ratio: NonNegativeFloat = Field(0.0001, description="lr ratio at the end of the cosine decay.")
    warmup_type: WarmupType = Field("log", description="Warmup curve.")
    last_batch_iteration: ConfigInt = Field(-1, ge=-1, description="Step to resume from; -1 starts fresh.")


SCHEDULER_PARAMS: dict[str, type[Section]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}
# DeepSpeed's other schedulers: known, not implemented.
KNOWN_UNSUPPORTED_SCHEDULERS = ("OneCycle", "LRRangeTest", "WarmupLRWithCosineDecay")


def scheduler_type_problem(type_name: Any) -> str | None:
    if not isinstance(type_name, str):
        return f'invalid value {show(type_name)}: expected a string such as "WarmupLR"'
    if type_name in SCHEDULER_PARAMS:
        return None
    if type_name in KNOWN_UNSUPPORTED_SCHEDULERS:
        return f"{show(type_name)} is not supported yet; supported: {', '.join(SCHEDULER_PARAMS)}"
    near = closest_key(type_name, [*SCHEDULER_PARAMS, *KNOWN_UNSUPPORTED_SCHEDULERS], cutoff=0.6)
    hint = f"; did you mean {near}?" if near else f"; supported: {', '.join(SCHEDULER_PARAMS)}"
    return f"unknown scheduler type {show(type_name)}{hint}"


class SchedulerConfig(Section):
    """The learning-rate schedule zero_engine builds when `initialize` gets no lr_scheduler object."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = Field(description="Schedule (exact name).")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Every parameter of the schedule, DeepSpeed's defaults filled in. total_num_steps left open "
        'by "auto" is null (resolved_params() fills it); warmup_max_lr null means the optimizer\'s lr.',
    )

    @classmethod
    def subsection_models(cls, raw: dict[str, Any]) -> dict[str, type[Section]]:
        type_name = raw.get("type")
        return _params_model(SCHEDULER_PARAMS, type_name if isinstance(type_name, str) else None)

    @classmethod
    def prepare(cls, raw: dict[str, Any], path: str, notes: LoadNotes) -> dict[str, Any]:
        return _check_type(raw, path, notes, scheduler_type_problem)

    @model_validator(mode="before")
    @classmethod
    def _fill_params(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "type" not in data:
            return data
        problem = scheduler_type_problem(data["type"])
        if problem is not None:
            raise PydanticCustomError(CONFIG_ERROR_TYPE, "{detail}", {"detail": problem, "subpath": "type"})
        params = data.get("params", {})
        if not isinstance(params, dict):
            raise PydanticCustomError(
                CONFIG_ERROR_TYPE, "{detail}",
                {"detail": f"invalid value {show(params)}: expected an object", "subpath": "params"},
            )
        try:
            validated = SCHEDULER_PARAMS[data["type"]].model_validate(params)
        except ValidationError as exc:
            raise nested_error(exc, "params") from None
        return {**data, "params": validated.model_dump()}

    def resolved_params(self, *, total_num_steps: int | None = None) -> dict[str, Any]:
        """`params` ready for the schedule's constructor, with total_num_steps filled in when "auto" left it open.

        total_num_steps: the optimizer steps the run will take (Hugging Face's Trainer passes its max_steps); only
        needed, and only used, when the config wrote "auto" for it. A `warmup_max_lr` of None stays None: the
        schedule then uses the optimizer's lr, as current DeepSpeed does.
        """
        params = dict(self.params)
        if "total_num_steps" in params and params["total_num_steps"] is None:
            if total_num_steps is None:
                raise ConfigError(
                    f'scheduler.params.total_num_steps: "auto" cannot be derived from the config ({self.type} '
                    "needs the length of the run; Hugging Face's Trainer fills it with max_steps). Write the number "
                    "of optimizer steps into the config, or pass total_num_steps= when building the scheduler."
                )
            params["total_num_steps"] = total_num_steps
        return params
