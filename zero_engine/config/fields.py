"""Building blocks shared by every config section.

* Strict scalar types. A ds_config.json is written by hand, so we accept exactly what JSON can say and nothing that
  pydantic's lax mode would silently coerce: an integer field takes an int or an integral float (`1e9`, which every
  JSON parser returns as a float) but not `5.5`, `"5"` or `true`; a bool field takes only `true`/`false`.
* `Auto`: the marker on a field that accepts the string "auto" (Hugging Face's convention) and how it resolves.
* `Section`: the frozen base model, with class-level tables the loader reads to check a section's keys
  (aliases, keys we know but do not implement yet, keys that are accepted and ignored).
"""
from __future__ import annotations

import difflib
import json
import math
import inspect
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, NamedTuple, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

if TYPE_CHECKING:
    from zero_engine.config.notes import LoadNotes

AUTO = "auto"

# Error type for problems our own validators detect; the loader turns them into ConfigError lines.
CONFIG_ERROR_TYPE = "zero_engine_config"


def value_error(message: str) -> PydanticCustomError:
    return PydanticCustomError(CONFIG_ERROR_TYPE, message)


# Integers beyond 64 bits cannot reach torch or C++ (they would fail later, far from the config): refused at load.
_INT_LIMIT = 2**63 - 1
_FLOAT_INT_LIMIT = int(1.7976931348623157e308)  # the largest integer a float holds; above it float() overflows


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise value_error("expected an integer")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise value_error("expected an integer; the number has a fractional part")
        value = int(value)
    if abs(value) > _INT_LIMIT:
        raise value_error("expected an integer that fits in 64 bits")
    return value


def _as_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise value_error("expected a number")
    if isinstance(value, int) and abs(value) > _FLOAT_INT_LIMIT:
        raise value_error("expected a finite number; this integer is too large for a float")
    if not math.isfinite(value):
        raise value_error("expected a finite number")
    return value  # pydantic makes it a float after range checks, so errors show the number as written


def _as_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise value_error("expected true or false")
    return value


ConfigInt = Annotated[int, BeforeValidator(_as_int)]
ConfigFloat = Annotated[float, BeforeValidator(_as_float)]
ConfigBool = Annotated[bool, BeforeValidator(_as_bool)]


class Auto(NamedTuple):
    """Field metadata: the field accepts "auto"; `rule` says what it becomes (shown in docs and the schema)."""

    rule: str


class NotSupported(NamedTuple):
    """A key DeepSpeed knows that we do not implement yet: accepted only while it is off.

    `default` is DeepSpeed's default (shown to the user); `is_off` decides whether a value is harmless,
    by default "equal to the default".
    """

    default: Any
    feature: str
    is_off: Callable[[Any], bool] | None = None
    accepted: str | None = None  # how to describe the accepted values when it is not just the default

    def describe_accepted(self) -> str:
        return self.accepted or f"only {json.dumps(self.default)}"

    def accepts(self, value: Any) -> bool:
        if self.is_off is not None:
            return self.is_off(value)
        return same_json_value(value, self.default)


def same_json_value(a: Any, b: Any) -> bool:
    """Equality as JSON sees it: 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def show(value: Any, limit: int = 80) -> str:
    """A value as the user wrote it (JSON), shortened for error messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def closest_key(key: str, known: list[str], cutoff: float = 0.6) -> str | None:
    matches = difflib.get_close_matches(key, known, n=1, cutoff=cutoff)
    return matches[0] if matches else None


def auto_rule(model: type[BaseModel], field_name: str) -> Auto | None:
    for meta in model.model_fields[field_name].metadata:
        if isinstance(meta, Auto):
            return meta
    return None


class Section(BaseModel):
    """Base of every config section: frozen (components receive it whole and never mutate it), and strict about
    keys. The class-level tables below are read by the loader (`keys.py`) and by the schema generator."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    # Other accepted spellings of a field, e.g. {"stage3_prefetch_bucket_size": "prefetch_bucket_size"}.
    key_aliases: ClassVar[dict[str, str]] = {}
    # Keys DeepSpeed knows that we do not implement yet; accepted only at their off value.
    not_supported: ClassVar[dict[str, NotSupported]] = {}
    # Keys accepted and ignored, each with the reason logged once, e.g. Apex's fp16.opt_level.
    ignored_keys: ClassVar[dict[str, str]] = {}
    # Deprecated keys the section maps onto current ones (the mapping lives in `prepare`), with the replacement.
    deprecated_keys: ClassVar[dict[str, str]] = {}
    # Fields parsed and validated that change nothing in zero_engine, each with why (shown in the docs; said once in
    # the log when a file sets it). A field must act or be listed here: tests/test_config_fields_act.py walks them.
    no_effect: ClassVar[dict[str, str]] = {}
    # Fields whose "auto" is a value of their own, decided by the engine at run time (not resolved at load).
    runtime_auto: ClassVar[frozenset[str]] = frozenset()
    # Fields the loader computes; never read from the file.
    derived_fields: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def file_fields(cls) -> list[str]:
        return [name for name in cls.model_fields if name not in cls.derived_fields]

    @classmethod
    def known_keys(cls) -> list[str]:
        return [*cls.file_fields(), *cls.key_aliases, *cls.not_supported, *cls.ignored_keys, *cls.deprecated_keys]

    @classmethod
    def subsection_models(cls, raw: dict[str, Any]) -> dict[str, type[Section]]:
        """Fields whose value is itself a section, so the loader checks its keys too."""
        found = {}
        for name, info in cls.model_fields.items():
            section = _section_in(info.annotation)
            if section is not None:
                found[name] = section
        return found

    @classmethod
    def prepare(cls, raw: dict[str, Any], path: str, notes: LoadNotes) -> dict[str, Any]:
        """Hook run on the raw section before its keys are checked (deprecations, legacy spellings)."""
        return raw


def _section_in(annotation: Any) -> type[Section] | None:
    if inspect.isclass(annotation) and issubclass(annotation, Section):
        return annotation
    for arg in get_args(annotation):
        section = _section_in(arg)
        if section is not None:
            return section
    return None
