"""helix_kv.errors: every exception in one namespace, structured attributes from one
constructor, the old import paths still working."""

from __future__ import annotations

import importlib
import pickle

import pytest

import helix_kv
import helix_kv._core as core
import helix_kv.errors as errors


def test_every_core_exception_is_in_helix_kv_errors() -> None:
    core_errors = {
        name
        for name, value in vars(core).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    assert core_errors, "the extension exports no exception"
    assert core_errors <= set(errors.__all__)
    for name in errors.__all__:
        value = getattr(errors, name)
        assert isinstance(value, type), name
        assert issubclass(value, Exception), name
        if name in core_errors:
            # the extension's class itself, or (for an error with attributes) a subclass of it
            assert issubclass(value, getattr(core, name)), name


def test_helix_kv_reexports_the_same_classes() -> None:
    for name in helix_kv.__all__:
        value = getattr(helix_kv, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            assert value is getattr(errors, name), name


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
    for name in (
        "UsageError",
        "SimulationSetupError",
        "TraceError",
        "PlotUnavailableError",
        "ProcsUnavailableError",
        "RankFailedError",
    ):
        assert not issubclass(getattr(errors, name), helix_kv.HelixKVError), name


def test_schedule_mismatch_attributes_come_from_the_constructor() -> None:
    error = errors.ScheduleMismatchError(
        "ranks differ", step=7, ranks=(1, 3), fields=["digest"], summaries={0: "a", 1: "b"}
    )
    assert str(error) == "ranks differ"
    assert (error.step, error.ranks, error.fields) == (7, [1, 3], ["digest"])
    assert error.summaries == {0: "a", 1: "b"}
    with pytest.raises(core.ScheduleMismatchError):  # the extension's class catches it
        raise error
    bare = errors.ScheduleMismatchError("call ended differently")
    assert (bare.step, bare.ranks, bare.fields, bare.summaries) == (None, [], [], {})


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
        errors.UsageError("bad flag", prog="helix-kv"),
        helix_kv.DeadlockError("stuck"),
    ],
)
def test_errors_pickle_with_their_attributes(error: Exception) -> None:
    # a --procs rank hands its error to the parent process this way
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert vars(copy) == vars(error)
