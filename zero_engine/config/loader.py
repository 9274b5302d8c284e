"""`load_config`: from a dict, a path or JSON text to a validated, frozen EngineConfig.

The steps, in order, so that each problem is reported by the step that understands it:
  1. read the source (duplicate keys are an error, as in DeepSpeed);
  2. check keys against the models (keys.py): typos first, then "not supported yet";
  3. resolve "auto" and the batch sizes (auto.py, batch.py), which needs the world size and maybe the model;
  4. validate values with the pydantic models; their errors become one ConfigError naming each key path.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from zero_engine.config.auto import resolve_auto
from zero_engine.config.fields import CONFIG_ERROR_TYPE, show
from zero_engine.config.keys import check_config_keys
from zero_engine.config.models import EngineConfig
from zero_engine.config.notes import LoadNotes
from zero_engine.errors import ConfigError


def load_config(source: dict | str | Path, world_size: int | None = None, model: Any = None) -> EngineConfig:
    """Load a DeepSpeed-style config.

    source: a dict, a path to a JSON file, or JSON text. world_size: data-parallel ranks for the batch rule;
    None means torch.distributed's world size when it is initialized, else 1. model: an nn.Module, used only to
    resolve "auto" bucket sizes from its hidden size.
    Raises ConfigError for every problem; logs deprecations, ignored keys and "auto" resolutions on logger
    "zero_engine.config".
    """
    try:
        return _load_config(source, world_size, model)
    except RecursionError:
        raise ConfigError("config: nested too deeply to read (more levels than Python's recursion limit); a "
                          "ds_config.json is a few levels deep") from None


def _load_config(source: dict | str | Path, world_size: int | None, model: Any) -> EngineConfig:
    raw = read_config_source(source)
    notes = LoadNotes()
    checked = check_config_keys(raw, notes)
    notes.raise_if_unsupported()
    world = resolve_world_size(world_size)
    resolved = resolve_auto(checked, world, model, notes)
    config = validate_section(EngineConfig, {**resolved, "world_size": world})
    notes.log()
    return config


def read_config_source(source: dict | str | Path) -> dict[str, Any]:
    if isinstance(source, dict):
        _check_string_keys(source, "(top level)")
        return copy.deepcopy(source)
    if isinstance(source, Path) or (isinstance(source, str) and not source.lstrip().startswith("{")):
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found (expected a path, JSON text or a dict)")
        origin = str(path)
        try:
            # utf-8-sig: a byte-order mark that some Windows editors write is accepted and dropped.
            text = path.read_bytes().decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{origin}: not UTF-8 text ({exc.reason} at byte {exc.start}); JSON files must be "
                              "UTF-8: re-save it as UTF-8") from None
    elif isinstance(source, str):
        text, origin = source, "JSON text"
    else:
        raise ConfigError(f"config source: expected a dict, a path or JSON text, got {type(source).__name__}")
    try:
        raw = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{origin}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: expected a JSON object at the top level, got {type(raw).__name__}")
    return raw


def _check_string_keys(raw: Any, path: str) -> None:
    """Dict input may carry keys JSON cannot (ints, tuples, None): name where, before anything uses them."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            if not isinstance(key, str):
                raise ConfigError(f"{path}: key {key!r} ({type(key).__name__}): config keys must be strings, as in "
                                  "JSON")
            _check_string_keys(value, key if path == "(top level)" else f"{path}.{key}")
    elif isinstance(raw, (list, tuple)):
        for item in raw:
            _check_string_keys(item, path)


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ConfigError(f"{key}: duplicate key in the same object; keep one")
        result[key] = value
    return result


def resolve_world_size(world_size: int | None) -> int:
    if world_size is None:
        import torch.distributed as dist  # deferred: only needed when the caller did not say

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size: invalid value {world_size!r}: expected a positive integer or None")
    return world_size


def validate_section(model: type[EngineConfig], data: dict[str, Any]) -> EngineConfig:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = [describe_validation_error(error) for error in exc.errors(include_url=False)]
    if len(lines) == 1:
        raise ConfigError(lines[0])
    raise ConfigError(f"{len(lines)} config problems:\n  " + "\n  ".join(lines))


def describe_validation_error(error: dict[str, Any]) -> str:
    """One pydantic error as "path: problem", the path in the file's terms."""
    parts = [str(part) for part in error["loc"]]
    ctx = error.get("ctx") or {}
    if ctx.get("subpath"):
        parts.append(ctx["subpath"])
    path = ".".join(parts) or "(top level)"
    kind = error["type"]
    if kind == CONFIG_ERROR_TYPE and "subpath" in ctx:
        return f"{path}: {ctx['detail']}"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind == "extra_forbidden":
        return f"{path}: unknown key"
    if kind in ("model_type", "dict_type"):
        return f"{path}: invalid value {show(error['input'])}: expected an object"
    message = error["msg"]
    return f"{path}: invalid value {show(error['input'])}: {message[:1].lower()}{message[1:]}"
