"""The JSON Schema of an accepted ds_config.json, and the markdown reference in docs/config.md.

Both are generated from the models so they cannot drift: pydantic gives each field's type, range, default and
description; the class-level tables add what a real file may contain besides field names (the `stage3_*`
aliases, deprecated keys, keys accepted only while off, ignored keys) and where "auto" is allowed.

Regenerate the committed copies with
    zero-engine schema > zero_engine/config_schemas/zero_engine.schema.json
    python -m zero_engine.config reference      # the block between the markers in docs/config.md
"""
from __future__ import annotations

import copy
import importlib.resources
import json
import sys
from pathlib import Path
from typing import Any

from pydantic_core import PydanticUndefined

from zero_engine.config.fields import AUTO, Section, auto_rule
from zero_engine.config.models import (
    ActivationCheckpointingConfig,
    AioConfig,
    Bf16Config,
    CheckpointConfig,
    CompileConfig,
    EngineConfig,
    Fp16Config,
    MemoryTimelineConfig,
    ZeroEngineSection,
)
from zero_engine.config.optim_models import (
    AdamParams,
    OptimizerConfig,
    SchedulerConfig,
    SgdParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from zero_engine.config.tp_models import TensorParallelConfig
from zero_engine.config.unsupported import HARMLESS_SECTIONS
from zero_engine.config.zero_models import LeafModuleConfig, OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

# Every section in reference order: (path in the file, model).
SECTIONS: list[tuple[str, type[Section]]] = [
    ("top level", EngineConfig),
    ("zero_optimization", ZeroConfig),
    ("zero_optimization.offload_param", OffloadParamConfig),
    ("zero_optimization.offload_optimizer", OffloadOptimizerConfig),
    ("zero_optimization.leaf_module", LeafModuleConfig),
    ("fp16", Fp16Config),
    ("bf16", Bf16Config),
    ("optimizer", OptimizerConfig),
    ("optimizer.params for Adam and AdamW", AdamParams),
    ("optimizer.params for SGD", SgdParams),
    ("scheduler", SchedulerConfig),
    ("scheduler.params for WarmupLR", WarmupLRParams),
    ("scheduler.params for WarmupDecayLR", WarmupDecayLRParams),
    ("scheduler.params for WarmupCosineLR", WarmupCosineLRParams),
    ("aio", AioConfig),
    ("activation_checkpointing", ActivationCheckpointingConfig),
    ("checkpoint", CheckpointConfig),
    ("compile", CompileConfig),
    ("tensor_parallel", TensorParallelConfig),
    ("zero_engine", ZeroEngineSection),
    ("zero_engine.memory_timeline", MemoryTimelineConfig),
]
_PARAMS_MODELS = (AdamParams, SgdParams, WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams)


def schema_file() -> Path:
    """The committed JSON Schema shipped inside the package (``zero-engine schema --path``), for an editor to use."""
    return Path(str(importlib.resources.files("zero_engine") / "config_schemas" / "zero_engine.schema.json"))


def json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the ds_config.json files load_config accepts, aliases and "auto" included,
    so an editor can validate a real file. Unknown top-level keys are allowed, as load_config only warns."""
    root = EngineConfig.model_json_schema(mode="validation")
    defs = root.pop("$defs", {})
    for model in _PARAMS_MODELS:
        schema = model.model_json_schema(mode="validation")
        defs.update(schema.pop("$defs", {}))
        defs[model.__name__] = schema
    for _, model in SECTIONS:
        _add_file_keys(root if model is EngineConfig else defs[model.__name__], model)
    _file_shapes(defs)
    root.pop("required", None)  # every key is optional in a file; the batch rule needs one batch size
    root["additionalProperties"] = True
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "zero_engine ds_config.json",
        "description": "DeepSpeed-compatible config accepted by zero_engine.config.load_config. Generated from "
        "zero_engine/config models; see docs/config.md.",
        **{key: value for key, value in root.items() if key not in ("title", "description")},
        "$defs": dict(sorted(defs.items())),
    }
    return _tidy(schema)


def _add_file_keys(node: dict[str, Any], model: type[Section]) -> None:
    properties = node.setdefault("properties", {})
    for name in model.derived_fields:
        properties.pop(name, None)
    required = [name for name in node.get("required", []) if name not in model.derived_fields]
    if required:
        node["required"] = required
    else:
        node.pop("required", None)
    for name in model.file_fields():
        rule = auto_rule(model, name)
        if rule is not None:
            properties[name] = _allow_auto(properties[name], rule.rule)
    for alias, field in model.key_aliases.items():
        properties[alias] = {**copy.deepcopy(properties[field]), "description": f"Alias of {field}."}
    for key, replacement in model.deprecated_keys.items():
        properties[key] = {"type": "boolean", "deprecated": True, "description": f"Deprecated: use {replacement}."}
    for key, rule in model.not_supported.items():
        note = f"Not supported yet ({rule.feature}); accepted: {rule.describe_accepted()}."
        if key in properties:
            properties[key]["description"] = f"{properties[key].get('description', '')} {note}".strip()
        else:
            properties[key] = {"description": note} if rule.is_off is not None else {
                "const": rule.default, "description": note}
    for key, reason in model.ignored_keys.items():
        properties[key] = {"description": f"Accepted and ignored: {reason}."}
    for key, reason in model.no_effect.items():
        properties[key]["description"] = f"{properties[key].get('description', '')} No effect here: {reason}.".strip()


def _allow_auto(prop: dict[str, Any], rule: str) -> dict[str, Any]:
    prop = dict(prop)
    outer = {key: prop.pop(key) for key in ("description", "default") if key in prop}
    description = outer.get("description", "")
    outer["description"] = f'{description} "auto": {rule}.'.strip()
    return {"anyOf": [prop, {"const": AUTO}], **outer}


def _file_shapes(defs: dict[str, Any]) -> None:
    """Where the file's shape differs from the model's: optimizer.params and scheduler.params depend on `type`
    (offer each type's params model), the optimizer type and checkpoint.tag_validation are case-insensitive, and
    offload may be `false`."""
    optimizer = defs["OptimizerConfig"]["properties"]
    optimizer["type"] = {
        "type": "string",
        "pattern": "^([Aa][Dd][Aa][Mm]([Ww])?|[Ss][Gg][Dd])$",
        "description": optimizer["type"].get("description", ""),
    }
    optimizer["params"] = {
        "anyOf": [{"$ref": "#/$defs/AdamParams"}, {"$ref": "#/$defs/SgdParams"}],
        "description": "Keyword arguments of the optimizer; which keys depends on type.",
    }
    checkpoint = defs["CheckpointConfig"]["properties"]
    checkpoint["tag_validation"] = {
        "type": "string",
        "pattern": "^([Ww][Aa][Rr][Nn]|[Ii][Gg][Nn][Oo][Rr][Ee]|[Ff][Aa][Ii][Ll])$",
        **{key: checkpoint["tag_validation"][key] for key in ("default", "description")},
    }
    zero = defs["ZeroConfig"]["properties"]
    for offload in ("offload_param", "offload_optimizer"):
        zero[offload]["anyOf"].append({"const": False})  # `false` means off, as `null`
    scheduler = defs["SchedulerConfig"]["properties"]
    scheduler["params"] = {
        "anyOf": [{"$ref": f"#/$defs/{model.__name__}"}
                  for model in (WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams)],
        "description": "Parameters of the schedule; which keys depends on type.",
    }


# pydantic writes a bound it could not attach to a JSON type (one inside `X | None` on a validated type) under its
# own name; JSON Schema validators ignore unknown keywords, so translate them.
_BOUND_KEYWORDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def _tidy(node: Any) -> Any:
    """Drop pydantic's generated titles (noise for an editor) and translate leftover bound keywords."""
    if isinstance(node, dict):
        tidy = {}
        for key, value in node.items():
            if key == "title" and isinstance(value, str):
                continue  # a property named "title" would map to a dict
            if key in _BOUND_KEYWORDS and "type" in node and isinstance(value, (int, float)):
                key = _BOUND_KEYWORDS[key]
            tidy[key] = _tidy(value)
        return tidy
    if isinstance(node, list):
        return [_tidy(value) for value in node]
    return node


# --- markdown reference ----------------------------------------------------------------------------------------

def config_reference_markdown() -> str:
    """The key-by-key reference of docs/config.md: one table per section (key, aliases, type, default, what "auto"
    becomes, effect), then the keys accepted only while off, the ignored keys and the deprecated keys."""
    schema = json_schema()
    lines: list[str] = []
    for path, model in SECTIONS:
        node = schema if model is EngineConfig else schema["$defs"][model.__name__]
        lines += _section_markdown(path, model, node)
    lines += ["### Top-level sections accepted and ignored", "",
              "Named once in the log (INFO) when present; they never change what training computes.", ""]
    lines += [f"- `{key}` ({why})" for key, why in HARMLESS_SECTIONS.items()]
    lines.append("")
    return "\n".join(lines)


def _section_markdown(path: str, model: type[Section], node: dict[str, Any]) -> list[str]:
    doc = " ".join((model.__doc__ or "").split())
    lines = [f"### `{path}`" if path != "top level" else "### Top level", "", doc, "",
             '| key | type | default | "auto" becomes | effect |', "|---|---|---|---|---|"]
    aliases_of: dict[str, list[str]] = {}
    for alias, field in model.key_aliases.items():
        aliases_of.setdefault(field, []).append(alias)
    for name in model.file_fields():
        prop = node["properties"][name]
        key = f"`{name}`" + "".join(f"<br>alias `{alias}`" for alias in aliases_of.get(name, []))
        rule = auto_rule(model, name)
        effect = prop.get("description", "").replace("|", "/")
        if rule is not None:
            effect = effect.split(' "auto": ')[0]
        lines.append(f"| {key} | {_type_text(prop)} | {_default_text(model, name)} | "
                     f"{rule.rule if rule else '-'} | {effect} |")
    lines.append("")
    if model.not_supported:
        lines.append("Accepted only while off (anything else is a `not supported yet` error):")
        lines += [f"- `{key}`: {rule.describe_accepted()} ({rule.feature})"
                  for key, rule in model.not_supported.items() if key not in model.model_fields]
        lines += [f"- `{key}` (value): {rule.describe_accepted()} ({rule.feature})"
                  for key, rule in model.not_supported.items() if key in model.model_fields]
        lines.append("")
    if model.ignored_keys and model is not EngineConfig:
        lines.append("Accepted and ignored, with a warning:")
        lines += [f"- `{key}`: {why}" for key, why in model.ignored_keys.items()]
        lines.append("")
    if model.deprecated_keys:
        lines.append("Deprecated, mapped with a warning:")
        lines += [f"- `{key}` -> {replacement}" for key, replacement in model.deprecated_keys.items()]
        lines.append("")
    return lines


def _type_text(prop: dict[str, Any]) -> str:
    if "anyOf" in prop:
        options = [_type_text(option) for option in prop["anyOf"] if option.get("const") != AUTO]
        return " or ".join(dict.fromkeys(options))  # without repeats: several params models are all "object"
    if "$ref" in prop:
        return "object"
    if "enum" in prop:
        return " / ".join(json.dumps(value) for value in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "pattern" in prop:
        return "string"
    kind = prop.get("type", "any")
    if kind == "array" and "prefixItems" in prop:
        return "[" + ", ".join(_type_text(item) for item in prop["prefixItems"]) + "]"
    bounds = []
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in prop:
            bounds.append(f"{sign} {prop[key]}")
    return f"{kind} {', '.join(bounds)}".strip()


def _default_text(model: type[Section], name: str) -> str:
    info = model.model_fields[name]
    if info.default_factory is not None:
        return "see section"
    if info.default is PydanticUndefined:
        return "required" if model is not EngineConfig else "see batch rule"
    if info.default == sys.maxsize:
        return "`sys.maxsize`"
    return f"`{json.dumps(info.default)}`"
