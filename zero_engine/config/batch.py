"""The batch-size rule: train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world.

Any two of the three determine the third, as in DeepSpeed. With one alone, gradient accumulation is 1. With none,
DeepSpeed refuses, and so do we. "auto" (Hugging Face's convention) counts as missing wherever the others
determine the value; where they do not, it takes Hugging Face's TrainingArguments default (micro batch 8,
accumulation 1). A derived value must divide exactly, else the error shows the arithmetic.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from zero_engine.config.fields import AUTO, show
from zero_engine.config.notes import LoadNotes
from zero_engine.errors import ConfigError

HF_DEFAULT_MICRO_BATCH = 8  # transformers.TrainingArguments.per_device_train_batch_size
HF_DEFAULT_ACCUMULATION = 1  # transformers.TrainingArguments.gradient_accumulation_steps

TRAIN, MICRO, GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


class BatchSizes(NamedTuple):
    train: int
    micro: int
    gas: int


def resolve_batch_sizes(raw: dict[str, Any], world: int, notes: LoadNotes) -> BatchSizes:
    given = {key: _batch_value(raw, key) for key in (TRAIN, MICRO, GAS)}
    train, micro, gas = (given[key] if isinstance(given[key], int) else None for key in (TRAIN, MICRO, GAS))
    derived: list[str] = []

    if train is None and micro is None:
        if AUTO not in (given[TRAIN], given[MICRO]):
            raise ConfigError(
                f"no batch size: give {TRAIN} or {MICRO} (DeepSpeed requires one of them; "
                f"{GAS} alone does not determine the batch)"
            )
        micro = HF_DEFAULT_MICRO_BATCH
    if gas is None and (train is None or micro is None):
        gas = HF_DEFAULT_ACCUMULATION  # one of train/micro alone: no accumulation, as DeepSpeed
    if train is None:
        train = micro * gas * world
    elif micro is None:
        micro = train // (gas * world)
        derived.append(MICRO)
    elif gas is None:
        gas = train // (micro * world)
        derived.append(GAS)

    if micro < 1 or gas < 1 or train != micro * gas * world:
        raise ConfigError(_mismatch_message(train, micro, gas, world, derived))
    sizes = BatchSizes(train, micro, gas)
    for key, value in zip((TRAIN, MICRO, GAS), sizes):
        if given[key] == AUTO:
            notes.auto(key, str(value))
    return sizes


def _batch_value(raw: dict[str, Any], key: str) -> int | str | None:
    value = raw.get(key)
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        isinstance(value, float) and not value.is_integer()
    ):
        raise ConfigError(f'{key}: invalid value {show(value)}: expected a positive integer or "auto"')
    if value < 1:
        raise ConfigError(f"{key}: invalid value {show(value)}: expected a positive integer")
    return int(value)


def _mismatch_message(train: int, micro: int, gas: int, world: int, derived: list[str]) -> str:
    message = f"{TRAIN} {train} != micro {micro} x gas {gas} x world {world} = {micro * gas * world}"
    if derived:
        divisor = micro * world if GAS in derived else gas * world
        message += f" ({derived[0]} derived; {TRAIN} must be a multiple of {divisor})"
    return f"batch sizes do not agree: {message}"
