"""Array helpers of the vLLM adapter's step, free of vLLM (so they are tested without it).

:class:`StopFilter` says which sampled tokens vLLM's stop check could stop at, for a whole
step in a few numpy operations, so the adapter runs vLLM's own ``check_stop`` on those rows
only: on every other row it would return False.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

_Ids = npt.NDArray[np.int64]

#: No end-of-sequence token (sampled tokens are int32, never this).
NO_TOKEN = -(1 << 40)


class StopFilter:
    """Per request (by the adapter's dense id): the end-of-sequence token, the stop tokens,
    and the token count at which the length cap stops it (0 for a request whose stop check
    reads more than its last token: repetition detection). :meth:`candidates` flags every
    row whose tokens vLLM's ``check_stop`` could stop at: a superset of its stops, exact for
    every condition but repetition detection (always flagged)."""

    def __init__(self, capacity: int) -> None:
        self.eos = np.full(capacity, NO_TOKEN, np.int64)
        #: vLLM stops when ``num_tokens >= max_model_len`` or ``num_output_tokens >=
        #: max_tokens``: the smaller of ``max_model_len`` and ``prompt + max_tokens``.
        self.limit = np.zeros(capacity, np.int64)
        self._with_eos = 0
        self._stop_tokens: dict[int, tuple[int, ...]] = {}
        self._keys: _Ids | None = np.zeros(0, np.int64)

    def grow(self, capacity: int) -> None:
        old = len(self.eos)
        for name, fill in (("eos", NO_TOKEN), ("limit", 0)):
            array = getattr(self, name)
            grown = np.full(capacity, fill, array.dtype)
            grown[:old] = array
            setattr(self, name, grown)

    def add(
        self, hid: int, eos: int | None, stop_tokens: Iterable[int], limit: int, always: bool
    ) -> None:
        """Registers request ``hid``'s stop conditions (vLLM's ``SamplingParams``); with
        ``always``, every token of it is flagged."""
        self.remove(hid)
        if eos is not None:
            self.eos[hid] = eos
            self._with_eos += 1
        self.limit[hid] = 0 if always else limit
        tokens = tuple(sorted({int(t) for t in stop_tokens if 0 <= int(t) < 1 << 32}))
        if tokens:
            self._stop_tokens[hid] = tokens
            self._keys = None

    def remove(self, hid: int) -> None:
        if self.eos[hid] != NO_TOKEN:
            self.eos[hid] = NO_TOKEN
            self._with_eos -= 1
        self.limit[hid] = 0
        if self._stop_tokens.pop(hid, None) is not None:
            self._keys = None

    def _sorted_keys(self) -> _Ids:
        """``hid << 32 | token`` of every live request's stop tokens, sorted (rebuilt after
        a request with stop tokens came or went)."""
        if self._keys is None:
            keys = [(hid << 32) | t for hid, tokens in self._stop_tokens.items() for t in tokens]
            self._keys = np.sort(np.asarray(keys, dtype=np.int64))
        return self._keys

    def candidates(
        self,
        hids: _Ids,
        tokens: npt.NDArray[np.int32],
        counts: _Ids | None,
        totals: _Ids,
    ) -> npt.NDArray[np.bool_]:
        """Per row (request ``hids[i]``, ``totals[i]`` tokens once its tokens of the step are
        appended): whether vLLM's stop check could stop it at one of its ``tokens``, row
        ``i`` having ``counts[i]`` of them, one after another (``counts`` None: one each)."""
        hit = totals >= self.limit[hids]
        keys = self._sorted_keys()
        if not self._with_eos and not len(keys):
            return hit
        owner = hids if counts is None else np.repeat(hids, counts)
        match = tokens == self.eos[owner]
        if len(keys):
            probe = (owner << 32) | tokens
            at = np.minimum(np.searchsorted(keys, probe), len(keys) - 1)
            match |= keys[at] == probe
        if counts is None:
            hit |= match
        elif match.any():
            hit[np.repeat(np.arange(len(hids)), counts)[match]] = True
        return hit
