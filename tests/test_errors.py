"""helix_kv.errors: every exception in one namespace, structured attributes from one
constructor, the old import paths still working."""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import pickle
import re
from pathlib import Path

import pytest

import helix_kv
import helix_kv._core as core
import helix_kv.errors as errors

ROOT = Path(__file__).resolve().parents[1]

# The command line's own errors: in helix_kv.errors, but not HelixKVErrors (docs/errors.md).
CLI_ERRORS = {
    "UsageError",
    "SimulationSetupError",
    "TraceError",
    "PlotUnavailableError",
    "ProcsUnavailableError",
    "RankFailedError",
    "CheckpointError",
}


def _exception_classes(module: object) -> dict[str, type]:
    return {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


def test_every_core_exception_is_in_helix_kv_errors_unchanged() -> None:
    core_errors = _exception_classes(core)
    assert core_errors, "the extension exports no exception"
    assert set(core_errors) <= set(errors.__all__)
    for name, cls in core_errors.items():
        assert getattr(errors, name) is cls, name  # re-exported, not shadowed by a subclass
    for name in errors.__all__:
        value = getattr(errors, name)
        assert isinstance(value, type), name
        assert issubclass(value, Exception), name


def test_the_extension_defines_only_the_errors_rust_raises() -> None:
    """One class per core error kind, InvalidTypeError (the binding's type checks) and their
    base; the group errors only the Python layer raises are defined in helix_kv.errors."""
    rust_raised = {
        "ConfigError",
        "InvalidArgumentError",
        "InvalidTypeError",
        "InvalidLengthError",
        "UnknownRequestError",
        "DuplicateRequestError",
        "RequestTooLargeError",
        "PreemptionDisabledError",
        "DeadlockError",
        "InvalidStateError",
    }
    assert set(_exception_classes(core)) == rust_raised | {"HelixKVError"}
    python_only = set(errors.__all__) - rust_raised - {"HelixKVError"}
    for name in python_only:
        assert getattr(errors, name).__module__ == "helix_kv.errors", name


def test_no_two_exception_classes_share_a_name() -> None:
    """Every exception class reachable from helix_kv (its modules' namespaces and every
    HelixKVError subclass) is the one class of its name."""
    modules = [core, errors, helix_kv]
    if importlib.util.find_spec("torch") is not None:
        modules.append(importlib.import_module("helix_kv.distributed"))
    by_name: dict[str, set[type]] = {}
    for module in modules:
        for name, cls in _exception_classes(module).items():
            if cls.__module__.startswith("helix_kv"):
                by_name.setdefault(name, set()).add(cls)
                by_name.setdefault(cls.__name__, set()).add(cls)
    for cls in _all_subclasses(helix_kv.HelixKVError):
        by_name.setdefault(cls.__name__, set()).add(cls)
    shared = {name: classes for name, classes in by_name.items() if len(classes) > 1}
    assert not shared


def _documented_tree(text: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The classes of docs/errors.md's hierarchy block and its ``(class, base)`` edges: each
    class under its parent in the tree, and each ``(also a X)`` it names."""
    block = text[text.index("```\nHelixKVError") + 4 :]
    block = block[: block.index("```")]
    names: set[str] = set()
    edges: set[tuple[str, str]] = set()
    stack: list[tuple[int, str]] = []  # (indent, class) of the open branches
    for line in block.splitlines():
        match = re.fullmatch(r"([│├└─ ]*)(\w+)\s*(?:\(also an? (\w+)\))?", line)
        assert match, line
        indent, name, also = len(match.group(1)), match.group(2), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if stack:
            edges.add((name, stack[-1][1]))
        if also:
            edges.add((name, also))
        names.add(name)
        stack.append((indent, name))
    return names, edges


def test_every_documented_error_exists_with_its_documented_bases() -> None:
    """Each class of docs/errors.md's tree and headings is in helix_kv.errors, a HelixKVError,
    and a subclass of what the tree puts it under; each HelixKVError of helix_kv.errors is in
    the tree, and the command line's errors are the ones named apart."""
    text = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    names, edges = _documented_tree(text)
    assert len(edges) > len(names) > 10  # the tree was read
    for name in names:
        assert issubclass(getattr(errors, name), helix_kv.HelixKVError), name
    for name, base in edges:
        base_class = getattr(errors, base, None) or getattr(builtins, base)
        assert issubclass(getattr(errors, name), base_class), (name, base)
    headings = set(re.findall(r"^### `(\w+)`", text, flags=re.MULTILINE))
    assert headings <= names
    typed = {n for n in errors.__all__ if issubclass(getattr(errors, n), helix_kv.HelixKVError)}
    assert typed == names
    cli_paragraph = text[text.index("The command line's own errors") :]
    cli_paragraph = cli_paragraph[: cli_paragraph.index("\n\n")]
    named = set(re.findall(r"`(\w+Error)`", cli_paragraph)) - {"HelixKVError"}
    assert {n for n in named if not hasattr(builtins, n)} == CLI_ERRORS
    assert set(errors.__all__) == typed | CLI_ERRORS


def test_helix_kv_reexports_the_same_classes() -> None:
    for name in helix_kv.__all__:
        value = getattr(helix_kv, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert value is getattr(errors, name), name
    exported = {n for n in helix_kv.__all__ if isinstance(getattr(helix_kv, n), type)}
    exported = {n for n in exported if issubclass(getattr(helix_kv, n), BaseException)}
    typed = {n for n in errors.__all__ if issubclass(getattr(errors, n), helix_kv.HelixKVError)}
    # the core and group errors; the InitSync* subclasses stay in helix_kv.errors/distributed
    assert exported == {n for n in typed if not n.startswith("InitSync") or n == "InitSyncError"}


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("helix_kv.simulate.arguments", ["UsageError"]),
        ("helix_kv.simulate.options", ["SimulationSetupError"]),
        ("helix_kv.simulate.workload", ["TraceError"]),
        ("helix_kv.simulate", ["TraceError"]),
        ("helix_kv.simulate.plot", ["PlotUnavailableError"]),
        ("helix_kv.simulate.procs", ["ProcsUnavailableError", "RankFailedError"]),
    ],
)
def test_old_import_paths_name_the_same_classes(module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    for name in names:
        assert getattr(imported, name) is getattr(errors, name)


def test_init_sync_errors_are_importable_from_distributed() -> None:
    pytest.importorskip("torch")
    distributed = importlib.import_module("helix_kv.distributed")
    for name in ("InitSyncConfigError", "InitSyncConfigGuardError", "InitSyncConfigMismatchError"):
        assert getattr(distributed, name) is getattr(errors, name)


def test_python_only_errors_keep_their_builtin_bases() -> None:
    # the CLI catches these apart from HelixKVError (exit status 2, or 1 for a rank crash)
    assert issubclass(errors.TraceError, ValueError)
    assert issubclass(errors.SimulationSetupError, ValueError)
    for cls in (errors.PlotUnavailableError, errors.ProcsUnavailableError, errors.RankFailedError):
        assert issubclass(cls, RuntimeError)
    for name in CLI_ERRORS:
        assert not issubclass(getattr(errors, name), helix_kv.HelixKVError), name


def test_schedule_mismatch_attributes_come_from_the_constructor() -> None:
    error = errors.ScheduleMismatchError(
        "ranks differ", step=7, ranks=(1, 3), fields=["digest"], summaries={0: "a", 1: "b"}
    )
    assert str(error) == "ranks differ"
    assert (error.step, error.ranks, error.fields) == (7, [1, 3], ["digest"])
    assert error.summaries == {0: "a", 1: "b"}
    with pytest.raises(helix_kv.HelixKVError):
        raise error
    bare = errors.ScheduleMismatchError("call ended differently")
    assert (bare.step, bare.ranks, bare.fields, bare.summaries) == (None, [], [], {})


def test_config_error_attributes_come_from_the_constructor() -> None:
    error = helix_kv.ConfigError("max_num_tokens = 8 is too few", field="max_num_tokens", value=8)
    assert str(error) == "max_num_tokens = 8 is too few"
    assert (error.field, error.value) == ("max_num_tokens", 8)
    bare = helix_kv.ConfigError("no one setting")
    assert (bare.field, bare.value) == (None, None)
    with pytest.raises(TypeError):
        helix_kv.ConfigError("m", "max_num_tokens")  # type: ignore[misc]  # keywords only
    # a subclass's own attributes name its field the same way
    option = errors.EngineOptionError(
        "no", engine="vllm", option="enable_lora", value="True", reason="LoRA"
    )
    assert (option.field, option.value, option.option) == ("enable_lora", "True", "enable_lora")
    assert errors.EngineOptionError("no", engine="vllm").field is None
    aggregate = errors.InitSyncConfigError("ranks failed", failed_ranks=[1])
    assert (aggregate.field, aggregate.value, aggregate.failed_ranks) == (None, None, [1])


def test_init_sync_errors_carry_their_ranks_and_reasons() -> None:
    error = errors.InitSyncConfigGuardError(
        "stopped", failed_ranks=[2], reasons={2: "ConfigGuardError: no"}
    )
    assert isinstance(error, helix_kv.InitSyncError)
    assert isinstance(error, helix_kv.ConfigGuardError)
    assert (error.failed_ranks, error.reasons) == ([2], {2: "ConfigGuardError: no"})
    lost = errors.InitSyncError("a peer died")
    assert (lost.failed_ranks, lost.reasons) == ([], {})

    mismatch = errors.InitSyncConfigMismatchError(
        "differ", ranks=[1], fields={"tokens_per_block": {0: 16, 1: 32}}, reasons={1: "tpb"}
    )
    assert isinstance(mismatch, helix_kv.ConfigMismatchError)
    assert isinstance(mismatch, helix_kv.ConfigError)
    assert mismatch.ranks == mismatch.failed_ranks == [1]
    assert mismatch.fields == {"tokens_per_block": {0: 16, 1: 32}}
    assert mismatch.reasons == {1: "tpb"}


@pytest.mark.parametrize(
    "error",
    [
        errors.ScheduleMismatchError("m", step=3, ranks=[1], fields=["f"], summaries={0: "s"}),
        errors.InitSyncError("i", failed_ranks=[0], reasons={0: "r"}),
        errors.InitSyncConfigMismatchError("c", ranks=[1], fields={"x": {0: 1, 1: 2}}),
        errors.EngineOptionError(
            "no", engine="vllm", option="enable_lora", value="True", reason="LoRA"
        ),
        errors.UsageError("bad flag", prog="helix-kv"),
        helix_kv.ConfigError("m", field="max_num_tokens", value=8),
        errors.InitSyncConfigError("i", failed_ranks=[0]),
        helix_kv.DeadlockError("stuck"),
    ],
)
def test_errors_pickle_with_their_attributes(error: Exception) -> None:
    # a --procs rank hands its error to the parent process this way
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)
