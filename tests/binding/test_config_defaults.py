"""The scheduler's defaults and option names live in the core (``SchedulerConfig.DEFAULTS``,
``VICTIM_POLICIES``, ...): the constructor, EngineConfig, the ``simulate`` CLI help and the
docs' tables all say the same, and nothing else restates them."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import helix_kv
from helix_kv.simulate.arguments import add_simulate_arguments

ROOT = Path(__file__).resolve().parents[2]
DEFAULTS = helix_kv.SchedulerConfig.DEFAULTS


def table_rows(page: str, heading: str) -> dict[str, list[str]]:
    """``{field: cells after the name}`` of the first table under ``heading`` in ``page``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        match = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_defaults_are_the_constructors_and_read_only() -> None:
    config = helix_kv.SchedulerConfig(kv_superblocks=4)
    resolved = config.to_dict()
    assert set(DEFAULTS) == set(resolved) - {"kv_superblocks"}
    for name, value in DEFAULTS.items():
        assert resolved[name] == value, name
    with pytest.raises(TypeError):
        DEFAULTS["cp_size"] = 2  # type: ignore[index]
    signature = inspect.signature(helix_kv.SchedulerConfig).parameters
    shown = {name: p.default for name, p in signature.items() if name in DEFAULTS}
    assert shown == dict(DEFAULTS)  # the text signature quotes the core's defaults
    assert set(signature) - set(DEFAULTS) == {"kv_superblocks", "kv_tokens"}


@pytest.mark.parametrize(
    ("keyword", "names"),
    [
        ("victim_policy", helix_kv.SchedulerConfig.VICTIM_POLICIES),
        ("serving_mode", helix_kv.SchedulerConfig.SERVING_MODES),
        ("capacity_policy", helix_kv.SchedulerConfig.CAPACITY_POLICIES),
        ("suspend_policy", helix_kv.SchedulerConfig.SUSPEND_POLICIES),
    ],
)
def test_option_names_are_exactly_the_accepted_ones(keyword: str, names: tuple) -> None:
    assert DEFAULTS[keyword] in names
    for name in names:
        assert (
            getattr(helix_kv.SchedulerConfig(kv_superblocks=4, **{keyword: name}), keyword) == name
        )
    with pytest.raises(helix_kv.ConfigError, match=", ".join(names)):
        helix_kv.SchedulerConfig(kv_superblocks=4, **{keyword: "no_such_name"})


def _user_text(value: Any) -> str:
    """How docs/configuration.md writes a default."""
    if value is None:
        return "`tokens_per_block`"  # chunk_unit: unset means tokens_per_block
    if isinstance(value, bool):
        return f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return str(value)


def test_configuration_reference_table_shows_the_core_defaults() -> None:
    rows = table_rows("docs/configuration.md", "## `SchedulerConfig`")
    assert set(DEFAULTS) <= set(rows)
    for name, value in DEFAULTS.items():
        assert rows[name][0] == _user_text(value), name


def _internals_text(value: Any) -> str:
    """How docs/internals/scheduler.md writes a default (the Rust core's terms)."""
    if value is None:
        return "tokens_per_block"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return "".join(part.title() for part in value.split("_"))
    return str(value)


def test_internals_table_shows_the_core_defaults() -> None:
    rows = table_rows("docs/internals/scheduler.md", "### `SchedulerConfig`")
    assert set(DEFAULTS) <= set(rows)
    for name, value in DEFAULTS.items():
        assert rows[name][1] == _internals_text(value), name


def test_simulate_help_quotes_the_core_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    helps = {action.dest: action.help or "" for action in parser._actions}
    flags = {
        "max_batch_size": "max_batch_size",
        "max_num_tokens": "max_num_tokens",
        "max_seq_len": "max_seq_len",
        "capacity_policy": "capacity_policy",
        "mode": "serving_mode",
        "policy": "victim_policy",
        "max_preemptions": "max_preemptions_per_request",
        "deadlock_steps": "deadlock_steps",
    }
    for dest, name in flags.items():
        assert f"default {DEFAULTS[name]})" in helps[dest] or helps[dest].endswith(
            f"default {DEFAULTS[name]}"
        ), (dest, helps[dest])


def test_engine_config_takes_the_core_defaults() -> None:
    pytest.importorskip("torch")
    import dataclasses

    from helix_kv.distributed import EngineConfig
    from helix_kv.distributed.config import SCHEDULER_FIELDS

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    assert set(SCHEDULER_FIELDS) == set(DEFAULTS) - {"cp_size", "cp_rank", "host_tier_superblocks"}
    for name in SCHEDULER_FIELDS:
        assert defaults[name] == DEFAULTS[name], name


def test_option_literal_aliases_are_the_core_names() -> None:
    """helix_kv.types spells the option names for type checkers; the core owns them."""
    from typing import get_args

    from helix_kv import types

    assert get_args(types.VictimPolicy) == helix_kv.SchedulerConfig.VICTIM_POLICIES
    assert get_args(types.ServingMode) == helix_kv.SchedulerConfig.SERVING_MODES
    assert get_args(types.CapacityPolicy) == helix_kv.SchedulerConfig.CAPACITY_POLICIES
    assert get_args(types.SuspendPolicy) == helix_kv.SchedulerConfig.SUSPEND_POLICIES
