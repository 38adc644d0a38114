"""The scheduler's fields are declared once, in the Rust core (``scheduler_config_fields!`` in
``rust/core/src/scheduler/config.rs``), and listed as ``SchedulerConfig.FIELDS``. The binding
builds the class from that list (keywords, getters, ``DEFAULTS``, the signature); everything
else that restates a field is checked here against it, field by field, and a failure names the
field and what is missing: the stub, ``EngineConfig``, the ``simulate`` flags and the tables of
``docs/configuration.md`` and ``docs/internals/scheduler.md``."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import helix_kv
from helix_kv import ConfigField, SchedulerConfig
from helix_kv.simulate.arguments import FIELD_FLAGS, HAND_DECLARED_FIELDS, add_simulate_arguments
from helix_kv.simulate.options import FLAG_NAMES, scheduler_flag

ROOT = Path(__file__).resolve().parents[2]
FIELDS = SchedulerConfig.FIELDS
DEFAULTS = SchedulerConfig.DEFAULTS
#: The widest integer each Rust type holds: a range up to it has no upper bound to check.
TYPE_MAX = {"u32": 2**32 - 1, "Option<u32>": 2**32 - 1, "u64": 2**64 - 1}
#: The constructor's two keywords for the KV pool, the one field without a default.
POOL_KEYWORDS = ("kv_superblocks", "kv_tokens")


def keywords(field: ConfigField) -> tuple[str, ...]:
    """The constructor keywords that give ``field``."""
    return POOL_KEYWORDS if field.required else (field.name,)


def python_type(field: ConfigField) -> str:
    """The annotation the stub and ``EngineConfig`` give ``field`` (an option enum: its
    ``helix_kv.types`` alias, which has the enum's name)."""
    simple = {"u32": "int", "u64": "int", "bool": "bool", "Option<u32>": "int | None"}
    return simple.get(field.type, field.type)


def report(problems: list[str]) -> str:
    return "SchedulerConfig fields out of step with the core's declaration:\n  " + "\n  ".join(
        problems
    )


# -- the binding: built from the list ------------------------------------------------------


def test_the_field_table_lists_the_class() -> None:
    config = SchedulerConfig(kv_superblocks=4)
    decision_fields = [name for name, _ in config.decision_fields()]
    assert decision_fields == [f.name for f in FIELDS if f.name != "cp_rank"]
    assert [f.name for f in FIELDS if f.required] == ["capacity_superblocks"]
    for field in FIELDS:
        value = getattr(config, field.name)
        assert value == (4 if field.required else field.default), field.name
        assert type(value) is type(field.default) or field.default is None, field.name
        assert getattr(SchedulerConfig, field.name).__doc__ == field.doc, field.name
        integer = field.type in TYPE_MAX
        assert (field.minimum is not None) == integer == (field.maximum is not None), field.name
    assert "ConfigField(name='cp_size', type='u32', default=1" in repr(FIELDS[0])


def test_defaults_signature_and_to_dict_come_from_the_fields() -> None:
    assert dict(DEFAULTS) == {f.name: f.default for f in FIELDS if not f.required}
    with pytest.raises(TypeError):
        DEFAULTS["cp_size"] = 2  # type: ignore[index]
    parameters = inspect.signature(SchedulerConfig).parameters
    assert list(parameters) == [keyword for f in FIELDS for keyword in keywords(f)]
    for field in FIELDS:
        for keyword in keywords(field):
            assert parameters[keyword].kind is inspect.Parameter.KEYWORD_ONLY
            assert parameters[keyword].default == field.default, keyword
    resolved = SchedulerConfig(kv_superblocks=4).to_dict()
    assert list(resolved) == [k for k in parameters if k != "kv_tokens"]
    with pytest.raises(TypeError, match="unexpected keyword argument 'capacity_superblocks'"):
        SchedulerConfig(capacity_superblocks=4)  # the core's name is no keyword
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_field'"):
        SchedulerConfig(kv_superblocks=4, no_such_field=1)


@pytest.mark.parametrize(
    "field", [f for f in FIELDS if f.minimum is not None], ids=lambda f: f.name
)
def test_each_declared_range_is_enforced(field: ConfigField) -> None:
    keyword = keywords(field)[0]
    base: dict[str, Any] = {"kv_superblocks": 4}
    assert field.minimum is not None
    if field.minimum > 0:
        with pytest.raises(helix_kv.ConfigError, match=field.name) as below:
            SchedulerConfig(**{**base, keyword: field.minimum - 1})
        # the field and its value as data, not only in the message
        assert (below.value.field, below.value.value) == (field.name, field.minimum - 1)
    assert field.maximum is not None
    if field.maximum < TYPE_MAX[field.type]:
        with pytest.raises(
            helix_kv.ConfigError, match=f"{field.name} = {field.maximum + 1}"
        ) as above:
            SchedulerConfig(**{**base, keyword: field.maximum + 1})
        assert (above.value.field, above.value.value) == (field.name, field.maximum + 1)
        assert getattr(SchedulerConfig(**{**base, keyword: field.maximum}), field.name) == (
            field.maximum
        )


@pytest.mark.parametrize(
    ("keyword", "names"),
    [
        ("victim_policy", SchedulerConfig.VICTIM_POLICIES),
        ("serving_mode", SchedulerConfig.SERVING_MODES),
        ("capacity_policy", SchedulerConfig.CAPACITY_POLICIES),
        ("suspend_policy", SchedulerConfig.SUSPEND_POLICIES),
    ],
)
def test_option_names_are_exactly_the_accepted_ones(keyword: str, names: tuple) -> None:
    field = next(f for f in FIELDS if f.name == keyword)
    assert field.choices == names
    assert DEFAULTS[keyword] in names
    for name in names:
        assert getattr(SchedulerConfig(kv_superblocks=4, **{keyword: name}), keyword) == name
    with pytest.raises(helix_kv.ConfigError, match=", ".join(names)) as unknown:
        SchedulerConfig(kv_superblocks=4, **{keyword: "no_such_name"})
    assert (unknown.value.field, unknown.value.value) == (keyword, "no_such_name")


def test_option_literal_aliases_are_the_core_names() -> None:
    """helix_kv.types spells the option names for type checkers; the core owns them."""
    from typing import get_args

    from helix_kv import types

    for field in FIELDS:
        if field.choices:
            assert get_args(getattr(types, field.type)) == field.choices, field.name


# -- the stub: parsed --------------------------------------------------------------------


def _stub_class(name: str) -> ast.ClassDef:
    tree = ast.parse((ROOT / "python/helix_kv/_core.pyi").read_text(encoding="utf-8"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_stub_declares_every_field_with_its_type_and_default() -> None:
    stub = _stub_class("SchedulerConfig")
    methods = {n.name: n for n in stub.body if isinstance(n, ast.FunctionDef)}
    new = methods["__new__"].args
    stub_keywords = {
        arg.arg: (ast.unparse(arg.annotation) if arg.annotation else "", default)
        for arg, default in zip(new.kwonlyargs, new.kw_defaults)
    }
    properties = {
        name: ast.unparse(node.returns) if node.returns else ""
        for name, node in methods.items()
        if any(isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list)
    }
    problems = []
    for field in FIELDS:
        for keyword in keywords(field):
            expected = "int | None" if field.required else python_type(field)
            if keyword not in stub_keywords:
                problems.append(f"{keyword}: no keyword of SchedulerConfig.__new__ in _core.pyi")
                continue
            annotation, default = stub_keywords[keyword]
            if annotation != expected:
                problems.append(f"{keyword}: the stub's keyword is {annotation}, not {expected}")
            if default is None or ast.literal_eval(default) != field.default:
                shown = "none" if default is None else ast.unparse(default)
                problems.append(f"{keyword}: the stub's default is {shown}, not {field.default!r}")
        if properties.get(field.name) != python_type(field):
            problems.append(
                f"{field.name}: the stub's property is {properties.get(field.name, 'missing')}, "
                f"not {python_type(field)}"
            )
    assert not problems, report(problems)


# -- EngineConfig ------------------------------------------------------------------------


def test_engine_config_takes_every_field_with_the_core_default() -> None:
    pytest.importorskip("torch")
    from helix_kv.distributed import EngineConfig
    from helix_kv.distributed.config import _NOT_ENGINE_FIELDS, SCHEDULER_FIELDS

    engine = {f.name: f for f in dataclasses.fields(EngineConfig)}
    problems = []
    for field in FIELDS:
        if field.required or field.name in _NOT_ENGINE_FIELDS:
            assert field.name not in SCHEDULER_FIELDS
            continue
        assert field.name in SCHEDULER_FIELDS
        if field.name not in engine:
            problems.append(f"{field.name}: no EngineConfig field (distributed/config.py)")
            continue
        if engine[field.name].default != field.default:
            problems.append(f"{field.name}: EngineConfig's default is {engine[field.name].default}")
        if engine[field.name].type != python_type(field):
            problems.append(f"{field.name}: EngineConfig's type is {engine[field.name].type}")
    assert not problems, report(problems)


# -- the simulate flags ------------------------------------------------------------------


def _simulate_actions() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return {action.dest: action for action in parser._actions}


def test_every_field_has_its_simulate_flag_from_the_core() -> None:
    """A field the CLI does not declare by hand gets its flag from the core: ``--<name>``
    (unless ``FLAG_NAMES`` renames it), the field's range or choices, its doc and default as
    help; unset, it is left to the core's default."""
    actions = _simulate_actions()
    assert set(FLAG_NAMES) <= {f.name for f in FIELDS}  # no stale entry
    assert set(FIELD_FLAGS) == {
        f.name for f in FIELDS if f.name not in HAND_DECLARED_FIELDS and scheduler_flag(f)
    }
    for field in FIELDS:
        if field.name not in FIELD_FLAGS:
            continue
        action = actions[field.name]
        assert action.option_strings == [FIELD_FLAGS[field.name]], field.name
        assert action.default is None, field.name
        help_text = action.help or ""
        doc = field.doc.replace("`", "").rstrip(".")
        assert help_text.startswith(doc[0].lower() + doc[1:]), field.name
        if field.type == "bool":
            assert action.const is (not field.default), field.name
            assert f"default {field.default};" in help_text, field.name
        elif field.choices:
            assert tuple(action.choices or ()) == field.choices, field.name
            assert help_text.endswith(f"(default {field.default})"), field.name
        else:
            assert field.minimum is not None
            assert field.maximum is not None
            parse = action.type
            assert callable(parse)
            assert parse(str(field.minimum)) == field.minimum, field.name
            with pytest.raises(argparse.ArgumentTypeError):
                parse(str(field.maximum + 1))
            if field.default is not None:
                assert help_text.endswith(f"(default {field.default})"), field.name


def test_hand_declared_flags_cover_the_rest() -> None:
    actions = _simulate_actions()
    assert actions["cp"].option_strings == ["--cp"]
    assert actions["tokens_per_block"].option_strings == ["--tokens-per-block"]
    assert actions["kv_tokens"].option_strings == ["--kv-tokens"]
    assert actions["host_tier_tokens"].option_strings == ["--host-tier-tokens"]
    no_flag = {f.name for f in FIELDS if f.name not in FIELD_FLAGS} - set(HAND_DECLARED_FIELDS)
    assert no_flag == {"cp_rank"}  # one scheduler per rank


# -- the docs' tables ----------------------------------------------------------------------


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


def _power(value: int) -> str:
    """``2^31-1`` for a bound one below a power of two, else the number."""
    bits = (value + 1).bit_length() - 1
    return f"2^{bits}-1" if value > 1024 and value + 1 == 1 << bits else str(value)


def rule_text(field: ConfigField) -> str:
    """How a table's rule column begins for an integer field: its declared range."""
    assert field.minimum is not None
    assert field.maximum is not None
    if field.maximum == TYPE_MAX[field.type]:
        return f"any {field.type}" if field.minimum == 0 else f">= {field.minimum}"
    return f"{field.minimum} ..= {_power(field.maximum)}"


def _user_text(value: Any) -> str:
    """How docs/configuration.md writes a default."""
    if value is None:
        return "`tokens_per_block`"  # chunk_unit: unset means tokens_per_block
    if isinstance(value, bool):
        return f"`{value}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return str(value)


def test_the_configuration_reference_table_has_every_field() -> None:
    rows = table_rows("docs/configuration.md", "## `SchedulerConfig`")
    problems = []
    for field in FIELDS:
        for keyword in keywords(field):
            if keyword not in rows:
                problems.append(f"{keyword}: no row in docs/configuration.md")
                continue
            default, rule, _, flag = rows[keyword]
            if not field.required and default != _user_text(field.default):
                problems.append(f"{keyword}: configuration.md's default is {default}")
            ranged = field.minimum is not None and keyword != "kv_tokens"  # in superblocks
            if ranged and not rule.startswith(rule_text(field)):
                problems.append(
                    f"{keyword}: configuration.md's rule should start {rule_text(field)}"
                )
            for choice in field.choices:
                if f"`{choice}`" not in rule:
                    problems.append(f"{keyword}: configuration.md's rule lacks `{choice}`")
            if field.name in FIELD_FLAGS and f"`{FIELD_FLAGS[field.name]}`" not in flag:
                problems.append(f"{keyword}: configuration.md names no `{FIELD_FLAGS[field.name]}`")
    scheduler_flags = (ROOT / "docs/configuration.md").read_text(encoding="utf-8")
    scheduler_flags = scheduler_flags[scheduler_flags.index("### Scheduler") :]
    for name, flag in FIELD_FLAGS.items():
        if f"`{flag}" not in scheduler_flags.split("###")[1]:
            problems.append(f"{name}: {flag} is not in configuration.md's list of scheduler flags")
    assert not problems, report(problems)


def _internals_text(value: Any) -> str:
    """How docs/internals/scheduler.md writes a default (the Rust core's terms)."""
    if value is None:
        return "tokens_per_block"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return _variant(value)
    return str(value)


def _variant(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


def test_the_internals_table_has_every_field() -> None:
    rows = table_rows("docs/internals/scheduler.md", "### `SchedulerConfig`")
    problems = []
    for field in FIELDS:
        if field.name not in rows:
            problems.append(f"{field.name}: no row in docs/internals/scheduler.md")
            continue
        ty, default, rule = rows[field.name]
        expected_default = "required" if field.required else _internals_text(field.default)
        if default != expected_default:
            problems.append(f"{field.name}: scheduler.md's default is {default}")
        if field.choices:
            variants = " / ".join(f"`{_variant(choice)}`" for choice in field.choices)
            if ty != f"enum {variants}":
                problems.append(f"{field.name}: scheduler.md's type should be enum {variants}")
        elif ty != field.type:
            problems.append(f"{field.name}: scheduler.md's type is {ty}, not {field.type}")
        if field.minimum is not None and not rule.startswith(rule_text(field)):
            problems.append(f"{field.name}: scheduler.md's rule should start {rule_text(field)}")
    assert not problems, report(problems)


def test_the_python_surface_listing_gives_every_keyword_its_default() -> None:
    """The signature listing of docs/internals/scheduler.md (``cfg = SchedulerConfig(...)``)
    names every keyword with its default (an option: its default first)."""
    text = (ROOT / "docs/internals/scheduler.md").read_text(encoding="utf-8")
    listing = text[text.index("cfg = SchedulerConfig(") : text.index("cfg.with_rank(r)")]
    shown = dict(re.findall(r"(\w+)=([^,|)]+)", re.sub(r"#.*", "", listing)))
    problems = []
    for keyword, parameter in inspect.signature(SchedulerConfig).parameters.items():
        if keyword not in shown:
            problems.append(f"{keyword}: not in scheduler.md's SchedulerConfig(...) listing")
        elif ast.literal_eval(shown[keyword].strip()) != parameter.default:
            problems.append(f"{keyword}: scheduler.md's listing shows {shown[keyword].strip()}")
    assert not problems, report(problems)


@pytest.mark.parametrize(
    ("build", "field", "value"),
    [
        # the rules between fields name the field the message leads with, and its value
        (
            lambda: SchedulerConfig(kv_superblocks=4, max_num_tokens=8, chunk_unit=16),
            "max_num_tokens",
            8,
        ),
        (
            lambda: SchedulerConfig(kv_superblocks=4, serving_mode="non_helix", cp_size=2),
            "serving_mode",
            "non_helix",
        ),
        (lambda: SchedulerConfig(kv_superblocks=4, cp_size=2, cp_rank=2), "cp_rank", 2),
        (lambda: SchedulerConfig(kv_superblocks=4).with_rank(5), "cp_rank", 5),
        (lambda: helix_kv.Layout(2, 2**24), "tokens_per_block", 2**24),
        (lambda: SchedulerConfig(kv_superblocks=0), "capacity_superblocks", 0),
        # the KV pool in tokens: the keyword, as given
        (lambda: SchedulerConfig(kv_tokens=8, cp_size=2, tokens_per_block=8), "kv_tokens", 8),
        (lambda: SchedulerConfig(kv_superblocks=4, kv_tokens=64), "kv_superblocks", None),
        # read from the keyword: the object given
        (lambda: SchedulerConfig(kv_superblocks=4, max_batch_size=-1), "max_batch_size", -1),
        (lambda: SchedulerConfig(kv_tokens=-3), "kv_tokens", -3),
        (lambda: helix_kv.Layout(0, 16), "cp_size", 0),
        (lambda: helix_kv.Layout(2, 2**33), "tokens_per_block", 2**33),
        (lambda: helix_kv.Ledger(helix_kv.Layout(1, 4), 0), "capacity_superblocks", 0),
    ],
)
def test_config_errors_carry_their_field_and_value(build: Any, field: str, value: Any) -> None:
    with pytest.raises(helix_kv.ConfigError) as caught:
        build()
    assert (caught.value.field, caught.value.value) == (field, value)
