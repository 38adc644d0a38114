"""The CP group's size and a rank's place in it are ``cp_size`` and ``cp_rank`` in the Python
API too; the old names ``cp`` and ``rank`` still work for one release (``helix_kv._renamed``),
with a DeprecationWarning that points at the caller. Giving both is a TypeError."""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import pytest

import helix_kv
from helix_kv.simulate.options import SimulationOptions, verified_ranks
from helix_kv.simulate.step_loop import run_simulation
from helix_kv.simulate.timing import StepTimeModel
from helix_kv.simulate.workload import RequestSpec

from .helpers.scheduler import needs_scheduler


def _placement() -> type:
    from helix_kv.executor import RankPlacement  # imports torch

    return RankPlacement


def _executor_config() -> type:
    from helix_kv.executor.runner import ExecutorConfig

    return ExecutorConfig


def _run_result() -> type:
    from helix_kv.executor.runner import RunResult

    return RunResult


def _bench_spec() -> type:
    from helix_kv.executor.bench import BenchSpec

    return BenchSpec


def _options() -> type:
    return SimulationOptions


_RESULT_FIELDS = {
    "outputs": {},
    "metrics": {},
    "request_metrics": {},
    "digests": [],
    "preempted": [],
    "capacity_superblocks": 4,
}

#: (the class, its fields with new names, a renamed field's old name -> new name)
RENAMED_FIELDS: list[tuple[Callable[[], type], dict[str, Any], dict[str, str]]] = [
    (_placement, {"cp_size": 4, "tokens_per_block": 8, "cp_rank": 3}, {"cp": "cp_size"}),
    (_placement, {"cp_size": 4, "tokens_per_block": 8, "cp_rank": 3}, {"rank": "cp_rank"}),
    (
        _placement,
        {"cp_size": 4, "tokens_per_block": 8, "cp_rank": 3},
        {"cp": "cp_size", "rank": "cp_rank"},
    ),
    (_executor_config, {"cp_size": 4, "tokens_per_block": 2}, {"cp": "cp_size"}),
    (_run_result, {"cp_rank": 1, **_RESULT_FIELDS}, {"rank": "cp_rank"}),
    (_bench_spec, {"cp_size": 4, "requests": 8}, {"cp": "cp_size"}),
    (_options, {"cp_size": 4, "kv_tokens": 1024}, {"cp": "cp_size"}),
]
IDS = [f"{make.__name__[1:]}-{'+'.join(old)}" for make, _, old in RENAMED_FIELDS]


def _needs_torch(make: Callable[[], type]) -> type:
    if make is not _options:
        pytest.importorskip("torch")
    return make()


@contextmanager
def no_deprecation() -> Iterator[None]:
    """Fails on any DeprecationWarning inside."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        yield


@contextmanager
def deprecated(*names: str) -> Iterator[None]:
    """Expects one DeprecationWarning per name (each naming it), all pointing at this file."""
    with pytest.warns(DeprecationWarning, match="is deprecated") as caught:
        yield
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == len(names), messages
    for name, message in zip(names, messages):
        assert name in message, message
    assert {w.filename for w in caught} == {__file__}, [w.filename for w in caught]


@pytest.mark.parametrize(("make", "given", "renames"), RENAMED_FIELDS, ids=IDS)
def test_new_field_names_do_not_warn(
    make: Callable[[], type], given: dict[str, Any], renames: dict[str, str]
) -> None:
    cls = _needs_torch(make)
    with no_deprecation():
        made = cls(**given)
        for new in renames.values():
            assert getattr(made, new) == given[new]
        changed = dataclasses.replace(made, **{new: given[new] for new in renames.values()})
        assert changed == made
        assert pickle.loads(pickle.dumps(made)) == made
        assert "cp=" not in repr(made)
        assert "rank=" not in repr(made).replace("cp_rank=", "")
    names = {field.name for field in dataclasses.fields(cls)}
    assert names.isdisjoint(renames)
    assert names.issuperset(renames.values())


@pytest.mark.parametrize(("make", "given", "renames"), RENAMED_FIELDS, ids=IDS)
def test_old_field_names_still_work_and_warn(
    make: Callable[[], type], given: dict[str, Any], renames: dict[str, str]
) -> None:
    cls = _needs_torch(make)
    made = cls(**given)
    old_keywords = {
        **{key: value for key, value in given.items() if key not in renames.values()},
        **{old: given[new] for old, new in renames.items()},
    }
    with deprecated(*(f"{cls.__name__}({old}=...)" for old in renames)):
        assert cls(**old_keywords) == made
    for old, new in renames.items():
        with deprecated(f"{cls.__name__}.{old} "):
            assert getattr(made, old) == given[new]
        with pytest.raises(AttributeError):
            setattr(made, old, given[new])
    # dataclasses.replace fills in every field, the new names too: the old keyword still
    # wins, and warns here
    changes = {old: given[new] + (1 if new == "cp_size" else -1) for old, new in renames.items()}
    with deprecated(*renames):
        changed = dataclasses.replace(made, **changes)
    assert all(getattr(changed, new) == changes[old] for old, new in renames.items())


@pytest.mark.parametrize(("make", "given", "renames"), RENAMED_FIELDS, ids=IDS)
def test_old_and_new_field_names_together_are_a_type_error(
    make: Callable[[], type], given: dict[str, Any], renames: dict[str, str]
) -> None:
    cls = _needs_torch(make)
    for old, new in renames.items():
        with pytest.raises(TypeError, match=f"both {new} and its deprecated name {old}"):
            cls(**given, **{old: given[new]})


def test_executor_config_with_takes_the_old_keyword() -> None:
    config_class = _needs_torch(_executor_config)
    config = config_class()
    with deprecated("with_(cp=...)"):
        assert config.with_(cp=2) == config_class(cp_size=2)
    with no_deprecation():
        assert config.with_(cp_size=2) == config_class(cp_size=2)


def test_run_group_takes_the_old_keyword() -> None:
    pytest.importorskip("torch")
    from helix_kv.executor.runner import ExecutorConfig, run_group

    # refused before any process is spawned: the job's group size is not the group's
    jobs = [({0: [1, 2]}, 1, ExecutorConfig(cp_size=2))]
    with no_deprecation(), pytest.raises(ValueError, match="cp_size = 2 in a group of 1"):
        run_group(jobs, cp_size=1)
    with deprecated("run_group(cp=...)"):  # noqa: SIM117 (one `with` of two is Python 3.10)
        with pytest.raises(ValueError, match="cp_size = 2 in a group of 1"):
            run_group(jobs, cp=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="both cp_size and its deprecated name cp"):
        run_group(jobs, cp=1, cp_size=1)  # type: ignore[call-arg]


def test_function_keywords_renamed() -> None:
    model = StepTimeModel(fixed_ms=2.0, per_token_ms=0.5, per_kv_token_ms=0.01)
    with no_deprecation():
        assert model.step_ms(10, 1000, cp_size=2) == pytest.approx(12.0)
        assert verified_ranks("sample", cp_size=4) == (0, 3)
    with deprecated("StepTimeModel.step_ms(cp=...)"):
        assert model.step_ms(10, 1000, cp=2) == pytest.approx(12.0)  # type: ignore[call-arg]
    with deprecated("verified_ranks(cp=...)"):
        assert verified_ranks("sample", cp=4) == (0, 3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="both cp_size"):
        verified_ranks("sample", cp=4, cp_size=4)  # type: ignore[call-arg]


@needs_scheduler
def test_scheduler_config_takes_the_old_rank_keyword() -> None:
    options = SimulationOptions(cp_size=2, kv_tokens=1024)
    with no_deprecation():
        assert options.scheduler_config(cp_rank=1).cp_rank == 1
    with deprecated("SimulationOptions.scheduler_config(rank=...)"):
        assert options.scheduler_config(rank=1).cp_rank == 1  # type: ignore[call-arg]


@needs_scheduler
def test_run_simulation_takes_the_old_keyword() -> None:
    config = helix_kv.SchedulerConfig(cp_size=2, tokens_per_block=4, kv_tokens=1024)
    workload = [RequestSpec(request_id=0, arrival_step=0, prompt_len=12, output_len=4)]
    model = StepTimeModel(fixed_ms=1.0, per_token_ms=0.1, per_kv_token_ms=0.01)

    def run(**cp: Any) -> float | None:
        group = helix_kv.SimulatedCPGroup(config)
        return run_simulation(group, workload, step_time=model, **cp).modelled_time_ms

    with no_deprecation():
        expected = run(cp_size=2)
    with deprecated("run_simulation(cp=...)"):
        assert run(cp=2) == expected
    with pytest.raises(TypeError, match="both cp_size"):
        run(cp=2, cp_size=2)


@needs_scheduler
def test_simulated_group_cp_is_a_deprecated_attribute() -> None:
    group = helix_kv.SimulatedCPGroup(helix_kv.SchedulerConfig(cp_size=3, kv_superblocks=8))
    with no_deprecation():
        assert group.cp_size == len(group) == 3
        assert repr(group).startswith("SimulatedCPGroup(cp_size=3, schedulers=")
    with deprecated("SimulatedCPGroup.cp "):
        assert group.cp == 3
    with pytest.raises(AttributeError, match="read-only"):
        group.cp = 4  # type: ignore[assignment]
