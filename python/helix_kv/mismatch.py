"""How the ranks of a CP group disagree on one step's schedule: the one description both the
in-process group (:class:`helix_kv.SimulatedCPGroup`) and the distributed schedule check
(:class:`helix_kv.distributed.ScheduleChecker`) raise.

Everything is read from the core's structured forms, never parsed from text: which
rank-invariant fields differ comes from :meth:`helix_kv.ScheduleOutput.differing_fields`, the
values shown from :meth:`~helix_kv.ScheduleOutput.summary_fields`, and which summary entry
shows which field from :attr:`~helix_kv.ScheduleOutput.SUMMARY_ENTRIES`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from helix_kv._core import ScheduleOutput
from helix_kv.errors import ScheduleMismatchError

__all__ = ["schedule_mismatch"]

#: Longest value quoted in the message (the full summaries ride on the error).
QUOTE_CHARS = 160

#: Array values shown for a field no summary entry shows.
SHOWN_VALUES = 12


def schedule_mismatch(
    outputs: Sequence[ScheduleOutput],
    extra: Sequence[Mapping[str, str]] | None = None,
    ranks: Sequence[int] | None = None,
) -> ScheduleMismatchError:
    """The :class:`~helix_kv.ScheduleMismatchError` for one step whose schedules differ.

    Args:
        outputs: every rank's output of the step, in rank order.
        extra: per rank, more ``{field: text}`` the ranks must agree on (e.g. the tokens fed
            to the previous ``update``); compared like fields and shown after them.
        ranks: the rank of each output, when they are not ranks ``0 .. len(outputs) - 1``
            (a group that runs a subset of its ranks).

    The divergent ranks are those outside the largest set that agrees on the digest and the
    extra fields (ties: the set holding the lowest rank); the error names them, the fields in
    which they differ from that set (:meth:`~helix_kv.ScheduleOutput.differing_fields`, then
    the extra ones) and the differing values: the summary entries that show those fields,
    else the arrays themselves. It carries ``step``, ``ranks``, ``fields`` and ``summaries``
    (rank -> ``summary()`` text).
    """
    extras = [dict(e) for e in extra] if extra is not None else [{} for _ in outputs]
    if len(extras) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs but {len(extras)} extra records")
    labels = list(range(len(outputs))) if ranks is None else [int(r) for r in ranks]
    if len(labels) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs but {len(labels)} ranks")
    groups: dict[tuple[int, tuple[tuple[str, str], ...]], list[int]] = {}
    for rank, (output, more) in enumerate(zip(outputs, extras)):
        groups.setdefault((int(output.digest), tuple(sorted(more.items()))), []).append(rank)
    majority = max(groups.values(), key=lambda ranks: (len(ranks), -min(ranks)))
    reference = min(majority)
    # indices into outputs from here on; labels[i] is the rank of outputs[i]
    divergent = [i for i in range(len(outputs)) if i not in majority]

    fields: list[str] = []
    for rank in divergent:
        names = outputs[reference].differing_fields(outputs[rank])
        more = {**extras[reference], **extras[rank]}
        names += [n for n in more if extras[rank].get(n) != extras[reference].get(n)]
        fields += [name for name in names if name not in fields]

    steps = sorted({int(output.step) for output in outputs})
    step = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    lines = [
        f"CP ranks disagree on the schedule of {step}: rank(s) {_ranks(labels, divergent)} differ "
        f"from rank(s) {_ranks(labels, majority)} in "
        f"{', '.join(fields) or 'nothing the outputs show'}"
    ]
    shown = [reference, *divergent]
    lines += _value_lines(outputs, extras, shown, fields, labels)
    lines.append(
        "  digests: "
        + ", ".join(f"rank {labels[i]} {int(o.digest):016x}" for i, o in enumerate(outputs))
    )
    lines.append(
        "Every decision must read only rank-invariant inputs; the requests, sampled tokens and "
        "config fed to each rank must be identical. Full summaries are on the error's "
        "`summaries` attribute."
    )
    return ScheduleMismatchError(
        "\n".join(lines),
        step=int(outputs[reference].step),
        ranks=[labels[i] for i in divergent],
        fields=fields,
        summaries={labels[i]: output.summary() for i, output in enumerate(outputs)},
    )


def _value_lines(
    outputs: Sequence[ScheduleOutput],
    extras: Sequence[Mapping[str, str]],
    shown: Sequence[int],
    fields: Sequence[str],
    labels: Sequence[int],
) -> list[str]:
    """``  name: rank A: value | rank B: value`` for each differing field, in order: the
    summary entries that show it (each once), else the field's own values."""
    entries = {rank: dict(outputs[rank].summary_fields()) for rank in shown}
    showing: dict[str, list[str]] = {}
    for entry, names in ScheduleOutput.SUMMARY_ENTRIES:
        for name in names:
            showing.setdefault(name, []).append(entry)
    lines: list[str] = []
    done: set[str] = set()
    named = [labels[rank] for rank in shown]
    for name in fields:
        if name == "digest":
            continue  # its own line
        if name in showing:
            for entry in showing[name]:
                values = [entries[rank][entry] for rank in shown]
                if entry not in done and len(set(values)) > 1:
                    done.add(entry)
                    lines.append(_line(entry, named, values))
            continue
        if any(name in extras[rank] for rank in shown):
            lines.append(_line(name, named, [extras[rank].get(name) for rank in shown]))
            continue
        lines.append(_line(name, named, [_array_text(getattr(outputs[r], name)) for r in shown]))
    return lines


def _line(name: str, ranks: Sequence[int], values: Sequence[str | None]) -> str:
    return f"  {name}: " + " | ".join(f"rank {r}: {_quote(v)}" for r, v in zip(ranks, values))


def _array_text(values: Any) -> str:
    array = np.asarray(values)
    text = " ".join(str(v) for v in array[:SHOWN_VALUES].tolist())
    return text + (f" ... ({array.size} values)" if array.size > SHOWN_VALUES else "")


def _ranks(labels: Sequence[int], indices: Sequence[int]) -> str:
    return ", ".join(str(labels[i]) for i in indices)


def _quote(value: str | None) -> str:
    if value is None:
        return "(absent)"
    if value == "":
        return "(none)"
    return value if len(value) <= QUOTE_CHARS else value[: QUOTE_CHARS - 3] + "..."
