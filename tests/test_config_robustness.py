"""Hostile config inputs: every one is a ConfigError naming the file or key, never another exception, and values that
would load but fail later (a loss scale of 2**100000, a 1 ns timeout) are refused at load. Pure unit tests.

The inputs are the classes of escapes a fuzz run found (issue 15 item 10): undecodable files, integer literals too
large for a float, nesting deeper than the recursion limit, non-string keys in dict input.
"""
from __future__ import annotations

import json

import pytest

from zero_engine.config import ConfigError, load_config

BASE = {"train_micro_batch_size_per_gpu": 1}


def error_of(source) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(source, world_size=1)
    return str(caught.value)


@pytest.mark.parametrize("encoding,text", [
    ("utf-16", json.dumps(BASE)),
    ("latin-1", '{"train_micro_batch_size_per_gpu": 1, "_comment": "caf\xe9"}'),
])
def test_a_file_that_is_not_utf8_is_a_config_error_naming_the_path(tmp_path, encoding, text):
    path = tmp_path / f"ds_{encoding}.json"
    path.write_bytes(text.encode(encoding))
    message = error_of(str(path))
    assert str(path) in message and "UTF-8" in message, message


def test_a_utf8_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(json.dumps(BASE).encode("utf-8-sig"))
    assert load_config(str(path), world_size=1).train_micro_batch_size_per_gpu == 1


@pytest.mark.parametrize("source", [
    '{"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1' + "0" * 400 + "}",
    {**BASE, "gradient_clipping": 10**400},
])
def test_integer_literals_too_large_for_a_float_name_the_key(source):
    message = error_of(source)
    assert message.startswith("gradient_clipping: invalid value"), message


def test_huge_integers_in_integer_fields_are_refused():
    message = error_of({**BASE, "gradient_accumulation_steps": 10**400})
    assert "gradient_accumulation_steps: invalid value" in message, message


@pytest.mark.parametrize("as_text", [True, False])
def test_nesting_beyond_the_recursion_limit_is_a_config_error(as_text):
    if as_text:
        source = '{"_x": ' + "[" * 1000 + "]" * 1000 + ', "train_micro_batch_size_per_gpu": 1}'
    else:
        deep: list = []
        for _ in range(1000):
            deep = [deep]
        source = {**BASE, "_x": deep}
    assert "nested too deeply" in error_of(source)


@pytest.mark.parametrize("source,path", [
    ({1: 2, **BASE}, "(top level)"),
    ({("a",): 2, **BASE}, "(top level)"),
    ({**BASE, "fp16": {1: 2}}, "fp16"),
    ({**BASE, "optimizer": {"type": "SGD", "params": {None: 1}}}, "optimizer.params"),
])
def test_non_string_keys_in_dict_input_name_where(source, path):
    message = error_of(source)
    assert message.startswith(f"{path}: ") and "keys must be strings" in message, message


@pytest.mark.parametrize("config,key", [
    ({"fp16": {"enabled": True, "initial_scale_power": 100000}}, "fp16.initial_scale_power"),
    ({"zero_engine": {"collective_timeout_s": 1e-9}}, "zero_engine.collective_timeout_s"),
    ({"zero_engine": {"collective_timeout_s": 1e300}}, "zero_engine.collective_timeout_s"),
    ({"gradient_accumulation_steps": 2**70}, "gradient_accumulation_steps"),
])
def test_values_that_would_fail_later_are_refused_at_load(config, key):
    message = error_of({**BASE, **config})
    assert f"{key}: invalid value" in message, message


def test_reasonable_extremes_still_load():
    cfg = load_config({**BASE, "fp16": {"enabled": True, "initial_scale_power": 32},
                       "zero_engine": {"collective_timeout_s": 1}}, world_size=1)
    assert cfg.fp16.initial_scale_power == 32 and cfg.zero_engine.collective_timeout_s == 1
