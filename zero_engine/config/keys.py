"""Key checking: walk the raw JSON alongside the section models before any value is validated.

Per section: aliases become field names (giving both is an error), deprecated keys are mapped, keys we know but
do not implement are checked to be off, ignored keys are noted, and an unknown key is an error naming the closest
known key. At the top level the rules differ (DESIGN.md "Config"): `_`-prefixed keys are comments, a key close to
a known one is a typo (error), any other unknown key belongs to another tool and is ignored with a warning.
"""
from __future__ import annotations

from typing import Any

from zero_engine.config.fields import AUTO, Section, auto_rule, closest_key, same_json_value, show
from zero_engine.config.models import EngineConfig
from zero_engine.config.notes import LoadNotes
from zero_engine.errors import ConfigError

# How close an unknown top-level key must be to a known one to count as a typo rather than another tool's key.
TOP_LEVEL_TYPO_RATIO = 0.85


def check_config_keys(raw: dict[str, Any], notes: LoadNotes) -> dict[str, Any]:
    """Return the top-level dict keyed by field names, holding only the sections the models validate."""
    raw = _map_deprecated_top_level(raw, notes)
    return check_section(raw, EngineConfig, "", notes)


def check_section(raw: Any, model: type[Section], path: str, notes: LoadNotes) -> Any:
    if not isinstance(raw, dict):
        return raw  # not an object: the model reports the type error with its path
    is_root = model is EngineConfig
    raw = model.prepare(raw, path or "(top level)", notes)
    subsections = model.subsection_models(raw)
    file_fields = set(model.file_fields())
    given_as: dict[str, str] = {}
    checked: dict[str, Any] = {}
    for key, value in raw.items():
        key_path = f"{path}.{key}" if path else key
        field = model.key_aliases.get(key, key)
        if field in file_fields:
            if field in model.no_effect:
                notes.no_effect(key_path, model.no_effect[field], changed=_differs_from_default(model, field, value))
            if field in given_as:
                raise ConfigError(
                    f"{key_path}: same setting as {_join(path, given_as[field])} (alias); keep only one of them"
                )
            given_as[field] = key
            _check_not_supported(model, field, value, key_path, notes)
            if isinstance(value, str) and value == AUTO and auto_rule(model, field) is None and \
                    field not in model.runtime_auto:
                raise ConfigError(f'{key_path}: "auto" cannot be resolved for this key; write a value')
            if field in subsections:
                value = check_section(value, subsections[field], key_path, notes)
            checked[field] = value
        elif key in model.not_supported:
            _check_not_supported(model, key, value, key_path, notes)
        elif key in model.ignored_keys:
            if is_root:
                notes.ignored_sections.append(key)
            else:
                notes.warn(f"{key_path} is ignored: {model.ignored_keys[key]}.")
        elif is_root:
            _unknown_top_level_key(key, notes)
        else:
            raise ConfigError(_unknown_key_message(key_path, key, model))
    return checked


def _differs_from_default(model: type[Section], field: str, value: Any) -> bool:
    default = model.model_fields[field].get_default(call_default_factory=True)
    if isinstance(default, Section):
        return bool(value)  # a section given with any key in it
    return not (same_json_value(value, default) or (default is None and value in (None, {}, False)))


def _check_not_supported(model: type[Section], key: str, value: Any, key_path: str, notes: LoadNotes) -> None:
    rule = model.not_supported.get(key)
    if rule is not None and not rule.accepts(value):
        notes.not_supported(
            f"{key_path}: {show(value)} is not supported yet ({rule.feature}); accepted: {rule.describe_accepted()}"
        )


def _unknown_key_message(key_path: str, key: str, model: type[Section]) -> str:
    known = model.known_keys()
    near = closest_key(key, known)
    if near is not None:
        return f"{key_path}: unknown key; did you mean {near}?"
    return f"{key_path}: unknown key; known keys here: {', '.join(sorted(model.file_fields()))}"


def _unknown_top_level_key(key: str, notes: LoadNotes) -> None:
    if key.startswith("_"):
        return  # a comment, by convention
    known = EngineConfig.known_keys()
    near = closest_key(key, known, cutoff=TOP_LEVEL_TYPO_RATIO) or _one_edit_away(key, known)
    if near is not None:
        raise ConfigError(f"{key}: unknown key; did you mean {near}?")
    notes.warn(f"{key}: unknown top-level key, ignored (not a DeepSpeed key zero_engine knows; another tool's?)")


def _one_edit_away(key: str, known: list[str]) -> str | None:
    """Catch typos in short keys ("fp61", "bf61") that a similarity ratio misses: one insertion, deletion,
    substitution or swap of neighbours."""
    if len(key) < 4:
        return None
    for candidate in known:
        if _at_most_one_edit(key, candidate):
            return candidate
    return None


def _at_most_one_edit(a: str, b: str) -> bool:
    if a == b:
        return True
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diffs = [i for i in range(len(a)) if a[i] != b[i]]
        if len(diffs) == 1:
            return True
        swapped = len(diffs) == 2 and diffs[1] == diffs[0] + 1
        return swapped and a[diffs[0]] == b[diffs[1]] and a[diffs[1]] == b[diffs[0]]
    shorter, longer = sorted((a, b), key=len)
    first_difference = next((i for i in range(len(shorter)) if shorter[i] != longer[i]), len(shorter))
    return shorter[first_difference:] == longer[first_difference + 1:]


def _map_deprecated_top_level(raw: dict[str, Any], notes: LoadNotes) -> dict[str, Any]:
    value = raw.get("zero_optimization")
    if isinstance(value, bool):
        # DeepSpeed's oldest format: a bool meaning stage 1 or off.
        stage = 1 if value else 0
        notes.deprecated(f"zero_optimization: {str(value).lower()}", f'zero_optimization: {{"stage": {stage}}}')
        raw = {**raw, "zero_optimization": {"stage": stage}}
    return raw


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key

