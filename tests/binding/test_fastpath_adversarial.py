"""An outside fuzzer's view of the calls an engine makes every step.

The rule under test (docs/errors.md, "Argument rules"): bad input raises a typed error of
helix_kv's one namespace (a :class:`helix_kv.HelixKVError`), the call changes nothing (state
digest, and the caller's output buffer where the docstring says so), the extension never
panics or aborts the process, and nothing is silently coerced.

Covered here, beyond ``test_hostile_inputs`` and ``test_step_metadata``:

- sequences that lie about their length (``__len__``): the binding reads their items, never
  trusts the size for an allocation;
- :func:`helix_kv.step_metadata_views` (a Python helper) raises helix_kv's errors;
- random call sequences (one step ahead, reverts of the newer step, aborts while pending,
  eos on the older step): every ``write_step_metadata`` / ``write_decode_rows`` equals a
  brute-force oracle built from ``block_table``, ``slot_mapping``, ``Layout`` and the
  ``ScheduleOutput`` arrays, on every rank;
- random hostile buffers, ``pad_to`` values and forged outputs: a typed error with the
  buffer and the scheduler unchanged, or a write;
- ``Ledger`` batch calls with one bad element hidden among good ones: all or nothing;
- outputs of another scheduler or another rank (known gaps, ``xfail(strict=True)``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

import helix_kv
from tests.helpers.scheduler import config, needs_scheduler, prompt, snapshot

pytestmark = needs_scheduler


# -- sequences that lie about their length -----------------------------------------------


class LyingList(list):  # type: ignore[type-arg]
    """A list whose ``len()`` is made up (``2**62`` by default): a binding that sizes an
    allocation from it overflows (a panic) or cannot allocate (the process aborts)."""

    claimed = 1 << 62

    def __len__(self) -> int:
        return self.claimed


class LyingSequence(Sequence[Any]):
    """A ``collections.abc.Sequence`` (not a list) whose ``len()`` is made up; iterating it
    yields its real items."""

    def __init__(self, items: Sequence[Any], claimed: int = 1 << 62) -> None:
        self.items = list(items)
        self.claimed = claimed

    def __len__(self) -> int:
        return self.claimed

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)


def lying(kind: str, items: Sequence[Any]) -> Any:
    return LyingList(items) if kind == "list" else LyingSequence(items)


def ledger_with(ids: Sequence[int], length: int = 6) -> helix_kv.Ledger:
    ledger = helix_kv.Ledger(helix_kv.Layout(2, 4), 16)
    ledger.add_many(list(ids), [length] * len(ids))
    assert ledger.grow_many(list(ids), [length] * len(ids)).all()
    return ledger


#: Each case calls one method with ``wrap`` applied to its sequence arguments and returns
#: something comparable: the same call with honest lists must give the same result.
LEDGER_CASES: dict[str, Callable[[Callable[[Sequence[Any]], Any]], Any]] = {
    "add_many": lambda w: (lambda led: (led.add_many(w([7, 8]), w([3, 4])), led.state_digest()))(
        ledger_with([1])
    ),
    "grow_many": lambda w: (
        lambda led: (led.grow_many(w([1]), w([9])).tolist(), led.state_digest())
    )(ledger_with([1])),
    "free_many": lambda w: (lambda led: (led.free_many(w([1])), led.state_digest()))(
        ledger_with([1, 2])
    ),
    "block_table": lambda w: ledger_with([1, 2]).block_table(w([2, 1])).tolist(),
    "slot_mapping": lambda w: ledger_with([1, 2]).slot_mapping(w([1, 2]), w([0, 2]), w([3, 4]), 1)
    .tolist(),
    "layout_owner_ranks": lambda w: helix_kv.Layout(2, 4).owner_ranks(w([0, 4, 9])).tolist(),
    "layout_slot_mapping": lambda w: helix_kv.Layout(2, 4)
    .slot_mapping([w([0, 1]), w([2, 3])], w([1, 0]), w([5, 1]), 0)
    .tolist(),
}


def scheduler_case(w: Callable[[Sequence[Any]], Any]) -> Any:
    s = helix_kv.Scheduler(config(1, 4, superblocks=16))
    s.add_request(1, w([5, 6, 7]), 3)
    s.add_request(2, w([5]), 3)
    out = s.schedule()
    finished = s.update(w([11] * out.num_samples), w([False, True]))
    s.abort_many(w([1]))
    return finished.tolist(), s.state_digest(), s.num_live


@pytest.mark.parametrize("kind", ["list", "sequence"])
@pytest.mark.parametrize("case", [*LEDGER_CASES, "scheduler"])
def test_a_made_up_len_is_not_trusted(case: str, kind: str) -> None:
    """A sequence claiming ``2**62`` items but holding two is read as its two items: the same
    result as the honest list, no ``PanicException`` (capacity overflow)."""
    call = scheduler_case if case == "scheduler" else LEDGER_CASES[case]
    honest = call(list)
    assert call(lambda items: lying(kind, items)) == honest


def test_a_made_up_len_cannot_abort_the_process() -> None:
    """``2**58`` items of 16 bytes fit ``isize`` but not memory: an allocation sized from the
    claim aborts the process (``memory allocation ... failed``, SIGABRT). Run in a child."""
    code = textwrap.dedent(
        """
        import helix_kv

        class LyingList(list):
            def __len__(self):
                return 1 << 58

        ledger = helix_kv.Ledger(helix_kv.Layout(1, 4), 16)
        ledger.add_many(LyingList([3]), LyingList([5]))
        s = helix_kv.Scheduler(helix_kv.SchedulerConfig(kv_superblocks=16))
        s.add_request(1, LyingList([1, 2]), 3)
        s.schedule()
        s.update(LyingList([4]), LyingList([True]))
        print("survived", len(ledger), s.num_live)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["survived", "1", "0"]


# -- helix_kv.step_metadata_views ---------------------------------------------------------


def test_step_metadata_views_raises_helix_kv_errors() -> None:
    """The Python helper follows the extension's rules: a wrong type or dtype is an
    ``InvalidTypeError``, a wrong shape or a strided buffer an ``InvalidArgumentError``, a
    buffer shorter than the layout an ``InvalidLengthError`` (no bare ``ValueError`` or
    ``AttributeError``)."""
    layout = helix_kv.StepMetadataLayout(8, 4, 2)
    words = layout.total_words
    good = np.zeros(words, dtype=np.int32)
    cases: list[tuple[object, object, type[Exception]]] = [
        (good.tolist(), layout, helix_kv.InvalidTypeError),
        (good.astype(np.int64), layout, helix_kv.InvalidTypeError),
        (good.astype(np.float32), layout, helix_kv.InvalidTypeError),
        (good.astype(">i4"), layout, helix_kv.InvalidTypeError),
        (good, "layout", helix_kv.InvalidTypeError),
        (good, None, helix_kv.InvalidTypeError),
        (np.zeros((2, words), dtype=np.int32), layout, helix_kv.InvalidArgumentError),
        (np.zeros(2 * words, dtype=np.int32)[::2], layout, helix_kv.InvalidArgumentError),
        (good[: words - 1], layout, helix_kv.InvalidLengthError),
        (np.zeros(0, dtype=np.int32), layout, helix_kv.InvalidLengthError),
    ]
    for buffer, lay, error in cases:
        with pytest.raises(error):
            helix_kv.step_metadata_views(buffer, lay)  # type: ignore[arg-type]
    views = helix_kv.step_metadata_views(good, layout)
    assert views.block_table.shape == (4, 2)
    assert np.shares_memory(views.slot_mapping, good)
