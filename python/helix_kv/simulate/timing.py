"""An optional step-time model: turns the simulator's scheduler steps into modelled milliseconds.

The simulator counts time in scheduler steps. To read latencies in milliseconds, a
:class:`StepTimeModel` gives every step a duration from what it scheduled::

    step_ms = fixed_ms
            + per_token_ms    * scheduled_tokens
            + per_kv_token_ms * kv_tokens_read / cp_size

- ``scheduled_tokens``: the tokens the step computes (``ScheduleOutput.num_tokens``: prefill
  chunk tokens plus one per decode entry, plus its draft tokens with speculative decoding);
- ``kv_tokens_read``: the global KV tokens the step's attention reads, each entry counting the
  KV its request holds once the step has written: ``position + 1 + drafts`` for a decode entry
  (``drafts`` is 0 without speculative decoding), ``start + length`` for a prefill chunk (see
  :func:`kv_tokens_read`);
- ``/ cp_size``: Helix spreads every request's KV over the ``cp_size`` ranks (``--cp``), which
  attend in parallel, so each rank reads about ``1/cp_size`` of it.

Speculative decoding is priced by the same two terms, an assumption: a decode verifying ``k``
drafts runs ``1 + k`` query tokens, each costing ``per_token_ms`` like any other token the step
computes (its share of the weights' FLOPs), and its attention reads the request's KV once for
all of them, ``position + 1 + k`` tokens, as a prefill chunk's queries read theirs once. What
the drafts cost to make (a draft model's or an MTP head's own forward) is not modelled: fold it
into the coefficients you fit.

A clock step in which nothing is scheduled (the simulator skips idle time to the next arrival)
lasts ``fixed_ms``. This is a model, not a measurement: a linear cost with three coefficients,
blind to kernels, batching efficiency, communication and everything else a real engine does.
:data:`DEFAULT_STEP_TIME` is illustrative; fit the coefficients to step times measured on your
own engine (``--step-time`` or ``--step-time-profile``): :func:`fit_step_time` fits them to
measured steps and :func:`save_profile` writes the profile ``--step-time-profile`` reads
(``benches/gpu_executor.py --export-step-time-profile`` does both on the reference executor).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from helix_kv._core import ScheduleOutput
from helix_kv._renamed import renamed_keywords
from helix_kv.errors import SimulationSetupError

__all__ = [
    "DEFAULT_STEP_TIME",
    "MAX_COEFFICIENT_MS",
    "PROFILE_KEYS",
    "StepTimeModel",
    "fit_step_time",
    "kv_tokens_read",
    "load_profile",
    "save_profile",
]

#: Largest coefficient accepted, in ms (over 16 minutes per unit): modelled times stay finite.
MAX_COEFFICIENT_MS = 1e6

#: The coefficients of a profile, in the order ``--step-time`` takes them.
PROFILE_KEYS = ("fixed_ms", "per_token_ms", "per_kv_token_ms")
#: A profile may also carry a free-text ``description`` (where its figures come from).
_OPTIONAL_PROFILE_KEYS = ("description",)


def _coefficient(name: str, value: Any) -> float:
    """``value`` as a coefficient: a finite real number in ``[0, MAX_COEFFICIENT_MS]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SimulationSetupError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an integer past float's range (a profile may hold one)
        number = math.inf if value > 0 else -math.inf
    if not math.isfinite(number) or number < 0:
        raise SimulationSetupError(f"{name} must be a finite number >= 0, got {value!r}")
    if number > MAX_COEFFICIENT_MS:
        raise SimulationSetupError(f"{name} must be at most {MAX_COEFFICIENT_MS:g}, got {value!r}")
    return number


@dataclass(frozen=True)
class StepTimeModel:
    """``step_ms = fixed_ms + per_token_ms * scheduled_tokens + per_kv_token_ms *
    kv_tokens_read / cp_size`` (see the module docstring). Coefficients are finite numbers in
    ``[0, MAX_COEFFICIENT_MS]``; anything else raises :class:`SimulationSetupError`.

    ``source`` says where the coefficients came from (``"default"``, ``"--step-time"``, a
    profile's path); ``description`` is a profile's own note. Neither changes a figure.
    """

    fixed_ms: float
    per_token_ms: float
    per_kv_token_ms: float
    source: str = "custom"
    description: str | None = None

    def __post_init__(self) -> None:
        for name in PROFILE_KEYS:
            object.__setattr__(self, name, _coefficient(name, getattr(self, name)))

    @renamed_keywords(cp="cp_size")
    def step_ms(self, scheduled_tokens: int, kv_tokens: int, cp_size: int) -> float:
        """The modelled duration of one step, in milliseconds, in a group of ``cp_size`` ranks
        (``cp``: its deprecated name, kept for one release)."""
        return (
            self.fixed_ms
            + self.per_token_ms * scheduled_tokens
            + self.per_kv_token_ms * kv_tokens / cp_size
        )

    @property
    def idle_step_ms(self) -> float:
        """A clock step with nothing scheduled: the fixed cost alone."""
        return self.fixed_ms

    def to_dict(self) -> dict[str, Any]:
        """The coefficients and their source (the report's ``config.step_time_model``)."""
        record: dict[str, Any] = {name: getattr(self, name) for name in PROFILE_KEYS}
        record["source"] = self.source
        if self.description is not None:
            record["description"] = self.description
        return record

    def to_profile(self) -> dict[str, Any]:
        """The profile :func:`load_profile` reads back: the coefficients, and the
        description where there is one."""
        record: dict[str, Any] = {name: getattr(self, name) for name in PROFILE_KEYS}
        if self.description is not None:
            record["description"] = self.description
        return record

    def predict_ms(self, scheduled_tokens: Any, kv_tokens: Any, cp_size: int = 1) -> np.ndarray:
        """:meth:`step_ms` of many steps at once (float64 array of the steps' shape)."""
        tokens = np.asarray(scheduled_tokens, dtype=np.float64)
        kv = np.asarray(kv_tokens, dtype=np.float64)
        return self.fixed_ms + self.per_token_ms * tokens + self.per_kv_token_ms * kv / cp_size

    def describe(self) -> str:
        """One line: the formula with the coefficients."""
        return (
            f"{self.fixed_ms:g} ms + {self.per_token_ms:g} ms/token "
            f"+ {self.per_kv_token_ms:g} ms/KV token per rank"
        )


DEFAULT_STEP_TIME = StepTimeModel(
    fixed_ms=5.0, per_token_ms=0.02, per_kv_token_ms=4e-5, source="default"
)
"""Illustrative coefficients, not measured: shaped after an 8B-parameter model in bf16 with one
H200-class GPU per rank. 5 ms per step is about the time to read 16 GB of weights at 3.3 TB/s;
0.02 ms per token about 16 GFLOP at 800 TFLOP/s; 4e-5 ms per KV token read about 128 KiB (32
layers x 8 KV heads x 128 dims x K and V x 2 bytes) at 3.3 TB/s."""


def kv_tokens_read(output: ScheduleOutput) -> int:
    """The global KV tokens a step's attention reads: for every decode entry, the tokens its
    request holds with the new one and its drafts (``position + 1 + drafts``, read once for
    its ``1 + drafts`` query tokens); for every prefill chunk, the tokens its request holds
    once the chunk is written (``start + length``)."""
    positions = output.generation_positions
    starts = output.context_starts
    lengths = output.context_lens
    drafts = output.generation_draft_counts
    decode = int(positions.sum(dtype=np.int64)) + positions.size + int(drafts.sum(dtype=np.int64))
    context = int(starts.sum(dtype=np.int64)) + int(lengths.sum(dtype=np.int64))
    return decode + context


def load_profile(path: str | Path) -> StepTimeModel:
    """Read a step-time profile: a JSON object with ``fixed_ms``, ``per_token_ms`` and
    ``per_kv_token_ms`` (finite numbers >= 0, in milliseconds) and an optional
    ``description`` string. Any other key, a missing one or a bad value raises
    :class:`SimulationSetupError` with a one-line reason (without the path: the caller adds
    it)."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as err:
        raise SimulationSetupError(f"cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise SimulationSetupError(f"not UTF-8 text ({err.reason})") from None
    try:
        profile = json.loads(text)
    except json.JSONDecodeError as err:
        raise SimulationSetupError(f"not JSON ({err.msg} at line {err.lineno})") from None
    if not isinstance(profile, dict):
        raise SimulationSetupError(f"expected a JSON object, got {type(profile).__name__}")
    unknown = sorted(set(profile) - set(PROFILE_KEYS) - set(_OPTIONAL_PROFILE_KEYS))
    if unknown:
        known = ", ".join(PROFILE_KEYS + _OPTIONAL_PROFILE_KEYS)
        raise SimulationSetupError(f"unknown key {unknown[0]!r} (the keys are {known})")
    missing = [key for key in PROFILE_KEYS if key not in profile]
    if missing:
        raise SimulationSetupError(f"missing key {missing[0]!r}")
    description = profile.get("description")
    if description is not None and not isinstance(description, str):
        raise SimulationSetupError(f"description must be a string, got {description!r}")
    return StepTimeModel(
        fixed_ms=profile["fixed_ms"],
        per_token_ms=profile["per_token_ms"],
        per_kv_token_ms=profile["per_kv_token_ms"],
        source=str(path),
        description=description,
    )


def fit_step_time(
    scheduled_tokens: Any,
    kv_tokens: Any,
    step_ms: Any,
    cp_size: int = 1,
    source: str = "fitted",
    description: str | None = None,
) -> StepTimeModel:
    """The coefficients that best fit measured steps: non-negative least squares of the
    relative error, ``sum(((model(step) - step_ms) / step_ms) ** 2)``, over steps that
    scheduled ``scheduled_tokens`` and read ``kv_tokens`` global KV tokens (as
    :func:`kv_tokens_read` counts them) in a group of ``cp_size`` ranks.

    Relative error, so that a 0.3 ms decode step weighs as much as a 30 ms prefill one; the
    coefficients non-negative, as :class:`StepTimeModel` needs them (each of the seven
    supports of the three is solved exactly and the best non-negative one kept). Bad input
    (no steps, arrays of different lengths, a time that is not a finite number > 0, a
    negative count, a ``cp_size`` below 1) raises :class:`SimulationSetupError`; so does a fit
    whose coefficients exceed :data:`MAX_COEFFICIENT_MS`.
    """
    tokens = np.asarray(scheduled_tokens, dtype=np.float64).reshape(-1)
    kv = np.asarray(kv_tokens, dtype=np.float64).reshape(-1)
    measured = np.asarray(step_ms, dtype=np.float64).reshape(-1)
    if not (tokens.size == kv.size == measured.size) or measured.size == 0:
        raise SimulationSetupError(
            f"fit_step_time needs as many token counts, KV counts and times, at least one: "
            f"got {tokens.size}, {kv.size} and {measured.size}"
        )
    if not np.all(np.isfinite(measured)) or np.any(measured <= 0):
        raise SimulationSetupError("fit_step_time: step times must be finite numbers > 0 ms")
    if not np.all(np.isfinite(tokens) & np.isfinite(kv)) or np.any(tokens < 0) or np.any(kv < 0):
        raise SimulationSetupError("fit_step_time: token and KV counts must be finite and >= 0")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise SimulationSetupError(
            f"fit_step_time: cp_size must be an integer >= 1, got {cp_size!r}"
        )
    # rows scaled by 1 / measured: the residuals are relative errors
    design = np.stack([np.ones_like(tokens), tokens, kv / cp_size], axis=1) / measured[:, None]
    target = np.ones_like(measured)
    best: tuple[float, np.ndarray] | None = None
    for support in ((0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)):
        columns = list(support)
        solution, *_ = np.linalg.lstsq(design[:, columns], target, rcond=None)
        if np.any(solution < 0):
            continue
        coefficients = np.zeros(3)
        coefficients[columns] = solution
        residual = float(np.sum((design @ coefficients - target) ** 2))
        if best is None or residual < best[0]:
            best = (residual, coefficients)
    assert best is not None  # a one-column fit of positive times is never negative
    fixed, per_token, per_kv = (float(c) for c in best[1])
    return StepTimeModel(fixed, per_token, per_kv, source=source, description=description)


def save_profile(model: StepTimeModel, path: str | Path) -> None:
    """Write ``model`` as a profile :func:`load_profile` (``--step-time-profile``) reads."""
    Path(path).expanduser().write_text(
        json.dumps(model.to_profile(), indent=2) + "\n", encoding="utf-8"
    )
