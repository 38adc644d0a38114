"""vLLM's ``Request`` objects in lockstep with helix_kv, without a write per request per step.

While the adapter schedules a request, its class is :class:`LockstepRequest` (a subclass of
vLLM's ``Request`` with no state of its own): the fields that change every step for every
request are read from the adapter's arrays when someone reads them, the way the read-only
views are derived from helix's state rather than kept as a second copy:

- ``num_computed_tokens`` and ``is_prefill_chunk``: the adapter's arrays by helix id, written
  for a whole step at once;
- ``spec_token_ids``: the drafter's lists, kept by helix id (the owner's last proposals are
  written there when first read);
- the token lists (``_output_token_ids``, ``_all_token_ids``, their views ``output_token_ids``
  and ``all_token_ids``, and ``block_hashes`` computed from them): the adapter counts the
  tokens of each request in vLLM's view; a read first appends the ones the list lacks from
  helix's own token log (the tokens helix was given, the same ones).

Reading any of them gives what vLLM's scheduler would have written; writing one (vLLM's code
and tests write some) writes the array. When a request finishes, every value is written back
into it and its class is vLLM's ``Request`` again.

This module imports vLLM: only ``helix_kv.integrations.vllm`` imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    _Request = object
else:
    from vllm.v1.request import Request as _Request

#: The instance attribute naming an attached request's adapter and helix id.
LINK = "_helix_lockstep"


class Owner(Protocol):
    """What the descriptors read: the adapter's arrays by helix id and its token sync."""

    _computed: npt.NDArray[np.int64]
    _chunk: npt.NDArray[np.bool_]
    _spec: npt.NDArray[np.object_]
    _ntokens: npt.NDArray[np.int64]
    _proposed: Any

    def _sync_tokens(self, request: Any, hid: int) -> None: ...

    def _write_proposals(self) -> None: ...


class _Column:
    """A field read from (and written to) one of the owner's arrays."""

    def __init__(self, array: str, cast: Callable[[Any], Any]) -> None:
        self.array = array
        self.cast = cast

    def __get__(self, request: Any, cls: Any = None) -> Any:
        if request is None:
            return self
        owner, hid = request.__dict__[LINK]
        return self.cast(getattr(owner, self.array)[hid])

    def __set__(self, request: Any, value: Any) -> None:
        owner, hid = request.__dict__[LINK]
        getattr(owner, self.array)[hid] = value


class _Drafts:
    """``spec_token_ids``: the owner's list of the request (None stands for a new empty one,
    made when first read, so a step clears every request's drafts in one array write)."""

    def __get__(self, request: Any, cls: Any = None) -> Any:
        if request is None:
            return self
        owner, hid = request.__dict__[LINK]
        if owner._proposed is not None:
            owner._write_proposals()
        drafts = owner._spec[hid]
        if drafts is None:
            drafts = owner._spec[hid] = []
        return drafts

    def __set__(self, request: Any, value: Any) -> None:
        owner, hid = request.__dict__[LINK]
        if owner._proposed is not None:
            owner._write_proposals()
        owner._spec[hid] = value


class _Tokens:
    """A token list (or its view, or the block hashes made from it), brought up to date
    from helix's token log when read."""

    name = ""

    def __set_name__(self, cls: Any, name: str) -> None:
        self.name = name

    def __get__(self, request: Any, cls: Any = None) -> Any:
        if request is None:
            return self
        state = request.__dict__
        owner, hid = state[LINK]
        if len(state["_all_token_ids"]) < owner._ntokens[hid]:
            owner._sync_tokens(request, hid)
        return state[self.name]

    def __set__(self, request: Any, value: Any) -> None:
        request.__dict__[self.name] = value


class LockstepRequest(_Request):
    """vLLM's ``Request`` while helix_kv schedules it (see the module docstring)."""

    __slots__ = ()

    num_computed_tokens = _Column("_computed", int)
    is_prefill_chunk = _Column("_chunk", bool)
    spec_token_ids = _Drafts()
    _output_token_ids = _Tokens()
    _all_token_ids = _Tokens()
    output_token_ids = _Tokens()
    all_token_ids = _Tokens()
    block_hashes = _Tokens()

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """vLLM's append (its lists are brought up to date first), counted."""
        super().append_output_token_ids(token_ids)  # type: ignore[misc]
        owner, hid = self.__dict__[LINK]
        owner._ntokens[hid] = len(self.__dict__["_all_token_ids"])


def attach(request: Any, owner: Owner, hid: int) -> None:
    """From now on ``request``'s per-step fields live in ``owner``'s arrays at ``hid``."""
    state = request.__dict__
    if owner._proposed is not None:
        owner._write_proposals()
    owner._computed[hid] = state["num_computed_tokens"]
    owner._chunk[hid] = state["is_prefill_chunk"]
    owner._spec[hid] = state["spec_token_ids"]
    owner._ntokens[hid] = len(state["_all_token_ids"])
    state[LINK] = (owner, hid)
    request.__class__ = LockstepRequest


def detach(request: Any) -> None:
    """Writes every field's value into ``request`` and gives it back vLLM's class (its
    tokens must be up to date: the owner syncs them first)."""
    state = request.__dict__
    owner, hid = state[LINK]
    values = {
        "num_computed_tokens": int(owner._computed[hid]),
        "is_prefill_chunk": bool(owner._chunk[hid]),
        "spec_token_ids": request.spec_token_ids,
    }
    del state[LINK]
    request.__class__ = _Request
    state.update(values)
    owner._spec[hid] = None


def append_tokens(request: Any, tokens: list[int]) -> None:
    """Appends ``tokens`` to a request's lists as vLLM's ``append_output_token_ids`` does
    (its block hashes included), without counting them (the owner's sync)."""
    state = request.__dict__
    state["_output_token_ids"].extend(tokens)
    state["_all_token_ids"].extend(tokens)
    if state["_block_hasher"] is not None:
        state["block_hashes"].extend(state["_block_hasher"](request))
