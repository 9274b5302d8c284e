"""Every config field either acts or says it does not (issue 15 item 9).

A field "acts" when the library reads it: an attribute access ``.<field>`` somewhere in zero_engine/ other than its
own definition. A field that changes nothing here is listed in its section's ``no_effect`` table with why; the docs
show the reason and a file that sets it gets one log line. The walk below fails on a field that is neither.

The static check is deliberately simple (a name read anywhere counts), so generic names (``enabled``, ``type``) pass
on any read; the fields it exists for have specific names (``reduce_scatter``, ``pin_memory``). The behaviour of
the fields made to act here (``model_persistence_threshold``, ``dataloader_drop_last``) is tested on ranks below.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import zero_engine
from zero_engine.config import load_config
from zero_engine.config.models import EngineConfig
from zero_engine.testing import run_ranks
from zero_engine.testing.models import GPT, GPTConfig

PACKAGE = Path(zero_engine.__file__).resolve().parent
TIMEOUT = 120

# Offload keys belong to issue 13 (helper "offload"), which makes them act or marks them; listed here until then so
# that this walk can land first. Remove each entry as it is read or marked (the test below fails on a stale entry).
PENDING_ISSUE_13: set[str] = set()


def fields(model=EngineConfig, prefix=""):
    for name in model.file_fields():
        yield model, name, prefix + name
    for name, section in model.subsection_models({}).items():
        yield from fields(section, f"{prefix}{name}.")


def sources() -> dict[str, str]:
    return {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")}


def is_read(name: str, texts: dict[str, str]) -> bool:
    # `.name` not followed by an assignment or an annotation (a definition or a setter); a colon that ends the line
    # (`if config.name:`) is a read.
    pattern = re.compile(r"\.%s\b(?!\s*(?:=[^=]|:[ \t]*[^\s]))" % re.escape(name))
    return any(pattern.search(text) for text in texts.values())


def test_every_field_acts_or_is_marked_without_effect():
    texts = sources()
    silent = [path for model, name, path in fields()
              if name not in model.no_effect and path not in PENDING_ISSUE_13 and not is_read(name, texts)]
    assert silent == [], (f"config fields neither read by zero_engine nor listed in their section's no_effect "
                          f"table: {silent}. Make each act, or add it to no_effect with why it changes nothing.")


def test_pending_offload_entries_are_not_stale():
    texts = sources()
    known = {path: (model, name) for model, name, path in fields()}
    stale = [path for path in PENDING_ISSUE_13
             if path not in known or known[path][1] in known[path][0].no_effect or is_read(known[path][1], texts)]
    assert stale == [], f"remove from PENDING_ISSUE_13 (now read or marked): {stale}"


def test_no_effect_entries_name_real_fields():
    for model, _, _ in fields():
        for name in model.no_effect:
            assert name in model.model_fields, f"{model.__name__}.no_effect lists {name}, not a field"


def test_a_key_without_effect_is_said_once_in_the_log(caplog):
    caplog.set_level(logging.INFO, logger="zero_engine.config")
    load_config({"train_batch_size": 8, "zero_optimization": {"reduce_scatter": False, "contiguous_gradients": True},
                 "activation_checkpointing": {"partition_activations": True, "profile": True}}, world_size=1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1, warnings
    assert "zero_optimization.reduce_scatter (gradients are always averaged with a reduce-scatter" in warnings[0]
    assert warnings[0].count("activation_checkpointing") == 1  # the section says it once for its keys
    assert any("zero_optimization.contiguous_gradients" in m for m in infos), infos


def test_docs_say_why_a_field_has_no_effect():
    text = (PACKAGE.parent / "docs" / "config.md").read_text()
    assert "No effect here: gradients are always averaged with a reduce-scatter" in text


# ---- fields made to act ------------------------------------------------------------------------------------------
def _persistence_body(model_cap):
    torch.manual_seed(0)
    engine, *_ = zero_engine.initialize(model=GPT(GPTConfig()), config={
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 200,
                              "stage3_model_persistence_threshold": model_cap}})
    return sum(sp.numel for sp in engine.sharded if sp.is_persistent), max(
        sp.numel for sp in engine.sharded if sp.numel <= 200)


def test_model_persistence_threshold_caps_the_persistent_total():
    uncapped, biggest = run_ranks(_persistence_body, 2, 10**9, timeout=TIMEOUT)[0]
    capped, _ = run_ranks(_persistence_body, 2, 150, timeout=TIMEOUT)[0]
    assert uncapped > 150 >= capped > 0, (uncapped, capped, biggest)


def _dataloader_body(drop_last):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "dataloader_drop_last": drop_last}
    _, _, loader, _ = zero_engine.initialize(model=torch.nn.Linear(1, 1), config=config, training_data=data)
    return len(loader)


def test_dataloader_drop_last_acts():
    assert run_ranks(_dataloader_body, 1, True, timeout=TIMEOUT) == [2]
    assert run_ranks(_dataloader_body, 1, False, timeout=TIMEOUT) == [3]
