"""helix_kv as vLLM's scheduler: ``HelixScheduler``, a ``SchedulerInterface`` for vLLM 0.32.

Use it as ``LLM(model, scheduler_cls="helix_kv.integrations.vllm.HelixScheduler", ...)`` or
``vllm serve MODEL --scheduler-cls helix_kv.integrations.vllm.HelixScheduler``
(``docs/vllm.md``). Every scheduling decision (admission, chunking, preemption, prefix-cache
hits and evictions, draft allocation and rollback) is made by :class:`helix_kv.Scheduler`;
this class translates vLLM's requests and model-runner outputs into its calls and its
schedules into vLLM's ``SchedulerOutput``, and keeps vLLM's ``Request`` objects in lockstep
(status, computed tokens, output tokens, events, prefill statistics, preemptions), since
vLLM's engine, metrics and output processing read them.

vLLM marks its scheduler interface as not public, so the adapter is pinned to the release it
was written against (:data:`VLLM_VERSION`; importing it under another vLLM fails at
construction with an :class:`~helix_kv.errors.EngineOptionError`).

Ids: each vLLM request gets a dense helix id (a free list, so per-request state lives in numpy
arrays indexed by it); an id goes back to the free list only once no pending helix step can
still hold it (one ``update_from_output`` after its request finished).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from helix_kv._core import ScheduleOutput, Scheduler, flatten_token_lists
from helix_kv.errors import HelixKVError
from helix_kv.integrations import _vllm_lockstep as lockstep
from helix_kv.integrations._vllm_batch import StopFilter
from helix_kv.integrations._vllm_config import (
    VLLM_VERSION,
    VllmMapping,
    check_version,
    helix_config,
)

if TYPE_CHECKING:
    _SchedulerInterface = object
    CachedRequestData: Any
    EngineCoreEventType: Any
    EngineCoreOutput: Any
    EngineCoreOutputs: Any
    NewRequestData: Any
    PauseState: Any
    PrefixCacheStats: Any
    RequestSpecDecodeMetrics: Any
    RequestStatus: Any
    SchedulerOutput: Any
    SchedulerStats: Any
    SpecDecodingStats: Any
    check_stop: Any
    strip_speculative_padding: Any
    vllm_version: str
else:
    from vllm import __version__ as vllm_version
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.interface import SchedulerInterface as _SchedulerInterface
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.metrics.stats import PrefixCacheStats, RequestSpecDecodeMetrics, SchedulerStats
    from vllm.v1.request import RequestStatus
    from vllm.v1.spec_decode.metrics import SpecDecodingStats
    from vllm.v1.structured_output.utils import strip_speculative_padding

__all__ = ["VLLM_VERSION", "HelixScheduler"]

logger = logging.getLogger(__name__)

#: The adapter's arrays by helix id: (attribute, dtype, the value of an unused id).
_COLUMNS: tuple[tuple[str, Any, Any], ...] = (
    ("_req_of", object, None),
    ("_rid_of", object, None),
    ("_prompt_len", np.int64, 0),
    # blocks of the request's table the model runner holds
    ("_known", np.int64, 0),
    ("_last_scheduled", np.int64, -2),
    ("_replace", np.bool_, False),
    ("_alive", np.bool_, False),
    # finished in vLLM's view (an abort, no token sampled) while helix still holds it
    ("_ended", np.bool_, False),
    # The runner's last page of each table, and a page it holds past helix's table end
    # (rejected drafts gave it back): -1 for none.
    ("_last_page", np.int64, -1),
    ("_stale", np.int64, -1),
    # vLLM's Request fields that change every step (``_vllm_lockstep``): computed tokens,
    # a prefill chunk, the drafts, the count of tokens in vLLM's view
    ("_computed", np.int64, 0),
    ("_chunk", np.bool_, False),
    ("_spec", object, None),
    ("_ntokens", np.int64, 0),
)

_Ids = npt.NDArray[np.int64]
_Objects = npt.NDArray[np.object_]
#: Rows whose tokens of a step are not yet in their request's lists, and each one's count
#: of tokens in vLLM's view with them.
_Lazy = tuple[_Ids, _Ids]


@dataclass
class _Step:
    """A schedule handed to vLLM and not yet updated: what its update needs."""

    output: Any
    #: helix's schedule; None for a step helix did not schedule (vLLM paused everything).
    helix: ScheduleOutput | None
    #: The generation entries' helix ids and vLLM ids (an id is not reused before the
    #: update of every pending step that holds it).
    gen_hids: _Ids
    gen_rids: list[str]
    #: The requests of the context chunks completing their prompt: they sample too, after
    #: the generation entries (helix's ``sample_ids`` order).
    ctx_reqs: list[Any]
    #: Drafts of each generation entry, or None when no entry carries any.
    drafts: npt.NDArray[np.int64] | None
    #: Helix ids of the generation entries carrying drafts (their tables may shrink).
    drafted_hids: _Ids | None
    #: Admissions of requests never run before, and of preempted ones (prefix-cache stats).
    admissions: tuple[int, int]

    @classmethod
    def unscheduled(cls, output: Any) -> _Step:
        """A step helix did not schedule (it scheduled nothing)."""
        nothing = np.zeros(0, np.int64)
        return cls(output, None, nothing, [], [], None, None, (0, 0))

    def gen_reqs(self, req_of: _Objects, rows: _Ids | None = None) -> list[Any]:
        """The generation entries' requests (of ``rows``), None for one retired meanwhile
        (an abort that took effect at an earlier update)."""
        hids = self.gen_hids if rows is None else self.gen_hids[rows]
        return req_of[hids].tolist()  # type: ignore[no-any-return]

    def sample_reqs(self, req_of: _Objects) -> list[Any]:
        """The request of each helix sample entry (helix's ``sample_ids`` order)."""
        return [*self.gen_reqs(req_of), *self.ctx_reqs]


@dataclass
class _Rows:
    """One schedule's entries as vLLM rows: generation entries, then context chunks."""

    hids: _Ids
    rids: list[str]
    #: Tokens each entry runs (a generation entry's includes its drafts).
    counts: _Ids
    #: vLLM's ``num_computed_tokens`` of each entry before the step.
    computed: _Ids
    #: 0 running, 1 new, 2 resumed (a preempted request re-admitted, or a table replaced).
    kinds: npt.NDArray[np.int8]
    num_generation: int
    #: The context entries' requests.
    ctx_reqs: list[Any]
    #: Whether any row is not a running one (``kinds.any()``).
    any_kind: bool = False
    #: The tokens of every entry when they all run as many (0 when they do not).
    uniform: int = 0
    #: Whether the generation entries are the previous step's, in the same order.
    repeated: bool = False
    #: The generation entries' prompt lengths.
    gen_prompts: _Ids | None = None

    @classmethod
    def empty(cls) -> _Rows:
        nothing = np.zeros(0, np.int64)
        return cls(nothing, [], nothing, nothing, np.zeros(0, np.int8), 0, [])

    def request(self, hid: int, row: int, req_of: _Objects) -> Any:
        """Row ``row``'s request (helix id ``hid``)."""
        g = self.num_generation
        return self.ctx_reqs[row - g] if row >= g else req_of[hid]


class HelixScheduler(_SchedulerInterface):
    """vLLM 0.32's ``SchedulerInterface`` with every decision made by helix_kv's scheduler.

    Built by vLLM's engine core with the arguments it gives every scheduler class; refuses
    at construction (:class:`~helix_kv.errors.EngineOptionError`, naming the option) what it
    cannot serve. A request it cannot serve is finished through vLLM's own error path
    (``FINISHED_ERROR`` in the next ``update_from_output``), never by an exception.
    """

    # The arrays by helix id (``_COLUMNS``).
    _req_of: _Objects
    _rid_of: _Objects
    _prompt_len: _Ids
    _known: _Ids
    _last_scheduled: _Ids
    _replace: npt.NDArray[np.bool_]
    _alive: npt.NDArray[np.bool_]
    _ended: npt.NDArray[np.bool_]
    _last_page: _Ids
    _stale: _Ids
    _computed: _Ids
    _chunk: npt.NDArray[np.bool_]
    _spec: _Objects
    _ntokens: _Ids

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        structured_output_manager: Any,
        block_size: int,
        hash_block_size: int | None = None,
        mm_registry: Any = None,
        include_finished_set: bool = False,
        log_stats: bool = False,
    ) -> None:
        check_version(vllm_version)
        config, mapping = helix_config(vllm_config, kv_cache_config, block_size)
        self.vllm_config = vllm_config
        self.scheduler_config = vllm_config.scheduler_config
        self.cache_config = vllm_config.cache_config
        self.structured_output_manager = structured_output_manager
        self.block_size = block_size
        self.log_stats = log_stats
        self.connector = None
        self.ec_connector = None
        self.helix = Scheduler(config)
        self._mapping: VllmMapping = mapping
        self.max_model_len = mapping.max_model_len
        self.num_spec_tokens = mapping.num_spec_tokens
        self.use_v2_model_runner = bool(vllm_config.use_v2_model_runner)
        self._async = mapping.async_scheduling
        self._caching = config.enable_prefix_caching
        self._return_sampling_mask = bool(
            getattr(vllm_config.model_config, "return_sampling_mask", False)
        )
        observability = vllm_config.observability_config
        self.spec_decode_metrics_level = observability.per_request_spec_decode_metrics
        # vLLM's names for the limits helix enforces (read by vLLM's tools and tests).
        self.max_num_running_reqs = self.scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_tokens
        self._finished_by_client: dict[int, set[str]] | None = (
            defaultdict(set) if include_finished_set else None
        )
        self._pause_state = PauseState.UNPAUSED
        self._init_ids(64)
        self._hid_of: dict[str, int] = {}
        self._pending: deque[_Step] = deque()
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self._rejected: list[tuple[Any, str]] = []
        self._retired: list[int] = []
        # Bumped whenever a request id is mapped or unmapped; the drafter's last ids with
        # their helix ids, valid while it stands.
        self._ids_version = 0
        self._draft_ids: tuple[list[str], int, _Ids] = ([], -1, np.zeros(0, np.int64))
        # The drafter's last proposals (helix ids, its lists, their lengths), not yet in
        # ``_spec``: the next schedule hands the lists on as they are when it verifies all of
        # them, and anything reading a request's drafts first writes them there.
        self._proposed: tuple[_Ids, list[list[int]], _Ids] | None = None
        # Live requests with trace headers, or another client than 0: while there are none,
        # a decode's output is built in the fewest steps.
        self._unusual = 0
        # Requests finished in vLLM's view that helix still holds (until their step closes).
        self._ended_live = 0
        # Whether some table may differ from the runner's copy (``_stale``, ``_replace``),
        # and the superblocks rejected drafts gave back so far.
        self._tables_changed = False
        self._returned = 0
        # The previous step's generation entries: helix ids, vLLM ids, prompt lengths.
        self._last_gen: tuple[_Ids, list[str], _Ids] | None = None
        self._steps = 0
        self._stats = _StatsBase(self.helix)

    # -- ids ----------------------------------------------------------------------------

    def _init_ids(self, capacity: int) -> None:
        for name, dtype, free in _COLUMNS:
            setattr(self, name, np.full(capacity, free, dtype))
        self._stops = StopFilter(capacity)
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def _grow_ids(self) -> None:
        old = len(self._req_of)
        new = old * 2
        for name, dtype, free in _COLUMNS:
            grown = np.full(new, free, dtype)
            grown[:old] = getattr(self, name)
            setattr(self, name, grown)
        self._stops.grow(new)
        self._free.extend(range(new - 1, old - 1, -1))

    def _new_hid(self, request: Any) -> int:
        if not self._free:
            self._grow_ids()
        hid = self._free.pop()
        for name, _, free in _COLUMNS:
            getattr(self, name)[hid] = free
        self._req_of[hid] = request
        self._rid_of[hid] = request.request_id
        self._prompt_len[hid] = request.num_prompt_tokens
        self._alive[hid] = True
        return hid

    def _attach(self, hid: int, request: Any) -> None:
        """helix took the request: its per-step fields now live here (``_vllm_lockstep``),
        and its stop conditions are registered for the step's stop filter."""
        params = request.sampling_params
        limit = min(self.max_model_len, request.num_prompt_tokens + request.max_tokens)
        self._stops.add(
            hid,
            params.eos_token_id,
            params.stop_token_ids or (),
            limit,
            params.repetition_detection is not None,
        )
        lockstep.attach(request, self, hid)

    def _detach(self, hid: int, request: Any, generated: Any = None) -> None:
        """The request leaves helix_kv (finished in vLLM's view or in helix): its fields are
        written back into it, its tokens brought up to date (from ``generated``, its output
        tokens, once helix no longer holds it)."""
        if lockstep.LINK in request.__dict__:
            self._sync_tokens(request, hid, generated)
            lockstep.detach(request)
            self._chunk[hid] = False
        self._stops.remove(hid)

    def _sync_tokens(self, request: Any, hid: int, generated: Any = None) -> None:
        """Appends to ``request``'s token lists the tokens of vLLM's view they lack (helix
        holds the same tokens: it was given them)."""
        have = len(request.__dict__["_all_token_ids"])
        total = int(self._ntokens[hid])
        if have >= total:
            return
        if generated is None:
            missing = self.helix.tokens(hid)[have:total]
        else:
            prompt = int(self._prompt_len[hid])
            missing = generated[have - prompt : total - prompt]
        lockstep.append_tokens(request, missing.tolist())

    def _retire(self, hid: int) -> None:
        """Lets go of a request helix finished: its output, its maps; the id is reused
        after the next update (a step still pending may hold it until then)."""
        output = self.helix.take_output(hid)
        request = self._req_of[hid]
        self._detach(hid, request, output.token_ids)
        if self._ended[hid]:
            self._ended_live -= 1
        self._req_of[hid] = None
        self._rid_of[hid] = None
        self._alive[hid] = False
        if self._hid_of.get(request.request_id) == hid:
            del self._hid_of[request.request_id]
            self._ids_version += 1
        if request.trace_headers is not None or request.client_index != 0:
            self._unusual -= 1
        self._retired.append(hid)

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        if request.request_id in self._hid_of:
            raise ValueError(
                f"request {request.request_id!r} is already live (streaming input sessions "
                "are not served by helix_kv's scheduler)"
            )
        reason = self._unservable(request)
        if reason is None:
            reason = self._add_to_helix(request)
        if reason is not None:
            logger.warning("helix_kv refuses request %s: %s", request.request_id, reason)
            self._rejected.append((request, reason))
        if self.spec_decode_metrics_level != "none":
            request.spec_decode_metrics = RequestSpecDecodeMetrics.new(self.num_spec_tokens)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def _unservable(self, request: Any) -> str | None:
        """Why helix_kv cannot serve ``request`` (None if it can)."""
        if request.pooling_params is not None or request.sampling_params is None:
            return "pooling requests are not served (no sampling parameters)"
        if request.prompt_token_ids is None or request.prompt_embeds is not None:
            return "prompt embeddings are not served (token prompts only)"
        if request.mm_features:
            return "multimodal inputs are not served"
        if request.lora_request is not None:
            return "LoRA adapters are not served"
        if request.use_structured_output:
            return "structured output (a grammar) is not served"
        if request.resumable:
            return "streaming input (resumable requests) is not served"
        if request.num_computed_tokens > 0:
            return "a request arriving with computed KV (a KV transfer) is not served"
        return None

    def _add_to_helix(self, request: Any) -> str | None:
        """Queues ``request`` in helix; why not, if helix refuses it."""
        max_new = min(request.max_tokens, self.max_model_len - request.num_prompt_tokens)
        if max_new < 1:
            return (
                f"a prompt of {request.num_prompt_tokens} tokens with max_tokens = "
                f"{request.max_tokens} leaves no token under max_model_len = {self.max_model_len}"
            )
        # Skipping prefix-cache reads: a salt of its own shares nothing with anyone.
        salt = (
            f"\x00skip-read\x00{request.request_id}"
            if request.skip_reading_prefix_cache
            else request.cache_salt
        )
        priority = -int(request.priority) if self._mapping.priority else 0
        priority = max(-(2**31), min(2**31 - 1, priority))
        hid = self._new_hid(request)
        try:
            self.helix.add_request(
                hid,
                np.asarray(request.prompt_token_ids, dtype=np.int32),
                max_new,
                priority,
                cache_salt=salt,
            )
        except (HelixKVError, OverflowError) as error:
            self._req_of[hid] = None
            self._rid_of[hid] = None
            self._alive[hid] = False
            self._free.append(hid)
            return f"{type(error).__name__}: {error}"
        self._hid_of[request.request_id] = hid
        self._ids_version += 1
        self._attach(hid, request)
        if request.trace_headers is not None or request.client_index != 0:
            self._unusual += 1
        return None

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: Any
    ) -> list[Any]:
        """Finishes requests from outside (an abort, a stop string): at once in vLLM's view;
        in helix at once between steps, else when the pending step closes (its KV pages are
        held until then, so the model runner never writes into a page given away)."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            ids: Iterable[str] = (request_ids,)
        elif request_ids is None:
            ids = [*self._hid_of, *(req.request_id for req, _ in self._rejected)]
        else:
            ids = set(request_ids)
        finished: list[Any] = []
        hids: list[int] = []
        self._ids_version += 1
        for request_id in ids:
            hid = self._hid_of.pop(request_id, None)
            if hid is None:
                request = self._take_rejected(request_id)
                if request is None:
                    continue
            else:
                request = self._req_of[hid]
                if request.is_finished():
                    continue
                hids.append(hid)
                self._end(hid, request)
            request.status = finished_status
            self._note_finished(request)
            finished.append(request)
        if hids:
            self.helix.abort_many(np.asarray(hids, dtype=np.uint64))
            if not self._pending:  # taken effect: retire them now
                for hid in hids:
                    self._retire(hid)
        return finished

    def _end(self, hid: int, request: Any) -> None:
        """The request finishes in vLLM's view while helix still holds it (until its abort
        takes effect): its fields are frozen into it now."""
        self._detach(hid, request)
        self._ended[hid] = True
        self._ended_live += 1

    def _take_rejected(self, request_id: str) -> Any:
        for i, (request, _) in enumerate(self._rejected):
            if request.request_id == request_id:
                del self._rejected[i]
                return request
        return None

    def _note_finished(self, request: Any) -> None:
        """What vLLM's scheduler does as a request finishes: its id goes to the model runner
        with the next schedule (and to its client with the next outputs)."""
        self._finished_ids.add(request.request_id)
        if self._finished_by_client is not None:
            self._finished_by_client[request.client_index].add(request.request_id)

    def _finish_in_error(self, request: Any, outputs: defaultdict[int, list[Any]]) -> None:
        """Ends ``request`` in error as vLLM's scheduler does: finished, and one output
        without tokens carrying its finish reason to its client."""
        request.status = RequestStatus.FINISHED_ERROR
        self._note_finished(request)
        outputs[request.client_index].append(
            EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
        )

    # -- the views vLLM's tools and tests read ----------------------------------------------

    def _live(self) -> tuple[list[Any], list[Any]]:
        """The live requests (no abort pending) in helix's queue order: (running, waiting),
        running being the ones holding KV, as helix says; then the refused ones waiting
        for their error output."""
        ids, held, aborting = self.helix.queue_holdings()
        keep = ~aborting
        running = self._req_of[ids[keep & (held > 0)].astype(np.int64)].tolist()
        waiting = self._req_of[ids[keep & (held == 0)].astype(np.int64)].tolist()
        return running, waiting + [request for request, _ in self._rejected]

    @property
    def running(self) -> list[Any]:
        """Requests holding KV (vLLM's ``RUNNING``), in helix's queue order (read-only)."""
        return self._live()[0]

    @property
    def waiting(self) -> list[Any]:
        """Requests waiting for admission, new or preempted (read-only)."""
        return self._live()[1]

    @property
    def requests(self) -> dict[str, Any]:
        """Every unfinished request by id (read-only)."""
        running, waiting = self._live()
        return {request.request_id: request for request in (*running, *waiting)}

    @property
    def finished_req_ids(self) -> set[str]:
        """Requests finished since the last schedule, which the next one hands to the model
        runner (read-only)."""
        return set(self._finished_ids)

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting), as :attr:`running` and :attr:`waiting` count them."""
        helix = self.helix
        if not self._pending and not self._ended_live:
            # between steps, with no abort pending, helix's counts are vLLM's (a request
            # admitted by a pending step holds KV but is waiting in helix until it ran)
            running, waiting = helix.num_running, helix.num_waiting
            if running + waiting == helix.num_live:
                return running, waiting + len(self._rejected)
        _, held, aborting = helix.queue_holdings()
        keep = ~aborting
        running = int(np.count_nonzero(keep & (held > 0)))
        waiting = int(np.count_nonzero(keep)) - running + len(self._rejected)
        return running, waiting

    def get_num_unfinished_requests(self) -> int:
        if self._pause_state == PauseState.PAUSED_ALL:
            return 0
        running, waiting = self.get_request_counts()
        return running + waiting

    def has_finished_requests(self) -> bool:
        return bool(self._finished_ids)

    def get_kv_cache_usage(self) -> float:
        return float(self.helix.metrics().kv_utilization)

    @property
    def pause_state(self) -> Any:
        return self._pause_state

    def set_pause_state(self, pause_state: Any) -> None:
        """``PAUSED_ALL`` schedules nothing. ``PAUSED_NEW`` (vLLM's engine queues new
        requests itself while paused) still lets helix admit requests already queued:
        helix has no admission hold, so a drain also finishes those."""
        logger.info("setting pause state to %s", pause_state.name)
        self._pause_state = pause_state

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Drops every cached superblock nobody references; True when the whole cache is
        gone (no request holds KV and no step is pending), as vLLM's own reset says.
        ``reset_running_requests`` (preempting every running request) is a decision helix
        does not offer: with running requests it resets nothing and returns False."""
        if reset_running_requests and self.get_request_counts()[0]:
            logger.warning(
                "helix_kv does not preempt running requests to reset the prefix cache; "
                "reset when they are done"
            )
            return False
        if self._pending:
            return False
        self.helix.reset_prefix_cache()
        reset = self.get_request_counts()[0] == 0
        if reset:
            self._stats.reset = True
        return reset

    def reset_connector_cache(self) -> bool:
        """No KV connector runs (they are refused): nothing to reset, which succeeds."""
        return True

    def reset_encoder_cache(self) -> None:
        """Nothing to reset: multimodal models are refused."""

    def get_grammar_bitmask(self, scheduler_output: Any) -> None:
        """Structured output is refused per request: there is never a grammar."""
        return None

    def shutdown(self) -> None:
        """Nothing to release: no connector, no event publisher."""

    # -- schedule --------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> Any:
        """helix's next step as vLLM's ``SchedulerOutput`` (``throttle_prefills`` is data
        parallelism's, which is refused)."""
        if self._pause_state == PauseState.PAUSED_ALL:
            # a step the runner sees too: no request of it ran in the previous one
            self._steps += 1
            self._last_gen = None
            return self._make_output(_Rows.empty(), [], [], {}, [])
        if self._async and self.num_spec_tokens:
            self._propose_placeholders()
        out = self.helix.schedule()
        seq = self._steps
        self._steps += 1
        if len(out.preempted_ids):
            self._preempt(out.preempted_ids.astype(np.int64))
        rows, admissions = self._rows(out)
        spec_tokens = self._spec_tokens(out, rows)
        block_ids = self._new_block_ids(rows)
        new_reqs, cached = self._split(rows, block_ids, seq)
        output = self._make_output(rows, new_reqs, cached, spec_tokens, block_ids)
        self._after_schedule(out, rows, seq)
        self._pending.append(self._step_record(out, rows, output, admissions))
        self._close_empty_steps()
        return output

    def _step_record(
        self, out: ScheduleOutput, rows: _Rows, output: Any, admissions: tuple[int, int]
    ) -> _Step:
        g = rows.num_generation
        gen = rows.hids[:g]
        ctx_reqs = rows.ctx_reqs
        if ctx_reqs:
            completes = out.context_completes.tolist()
            ctx_reqs = [request for request, done in zip(ctx_reqs, completes) if done]
        drafts = out.generation_draft_counts
        drafted = bool(self.num_spec_tokens) and bool(g) and bool(drafts.any())
        return _Step(
            output=output,
            helix=out,
            gen_hids=gen,
            gen_rids=rows.rids[:g] if len(rows.rids) > g else rows.rids,
            ctx_reqs=ctx_reqs,
            drafts=drafts if drafted else None,
            drafted_hids=gen[drafts > 0] if drafted else None,
            admissions=admissions,
        )

    def _close_empty_steps(self) -> None:
        """Closes the oldest pending steps while they schedule nothing: the model runner
        has nothing of theirs to return, and a caller may never hand their (empty) output
        back (vLLM's tests drop them; its engine hands them back, a no-op then)."""
        while self._pending and not self._pending[0].output.total_num_scheduled_tokens:
            step = self._pending.popleft()
            if step.helix is not None:
                released, self._retired = self._retired, []
                finished = self.helix.update(np.zeros(0, np.int32))
                self._free.extend(released)
                for hid in finished.tolist():
                    self._finish(hid, defaultdict(list))

    def _preempt(self, hids: _Ids) -> None:
        """vLLM's view of helix's recompute-pauses: the request waits again, from nothing."""
        timestamp = time.monotonic()
        for hid in hids.tolist():
            request = self._req_of[hid]
            if request is None or request.is_finished():
                continue
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            if request.spec_token_ids:
                request.spec_token_ids = []
            request.num_output_placeholders = 0
            request.num_preemptions += 1
            if self.log_stats:
                request.record_event(EngineCoreEventType.PREEMPTED, timestamp)
            self._preempted_ids.add(request.request_id)
            self._known[hid] = 0
            self._replace[hid] = False
            self._last_page[hid] = -1
            self._stale[hid] = -1

    def _rows(self, out: ScheduleOutput) -> tuple[_Rows, tuple[int, int]]:
        """The step's entries as rows, with vLLM's view of each admission applied."""
        gen = out.generation_ids.view(np.int64)
        last = self._last_gen
        repeated = last is not None and len(last[0]) == len(gen) and bool((last[0] == gen).all())
        if repeated:  # the same decodes as in the previous step (the common case)
            assert last is not None
            gen_rids, prompts = last[1], last[2]
        else:
            gen_rids, prompts = self._rid_of[gen].tolist(), self._prompt_len[gen]
        self._last_gen = (gen, gen_rids, prompts)
        counts = out.generation_draft_counts + 1
        ctx = out.context_ids.view(np.int64)
        if not len(ctx):
            kinds = np.zeros(len(gen), np.int8)
            rows = _Rows(gen, gen_rids, counts, out.generation_positions, kinds, len(gen), [])
            rows.repeated, rows.gen_prompts = repeated, prompts
            if not self.num_spec_tokens:  # one token each
                rows.uniform = 1
            elif len(counts) and counts.min() == counts.max():
                rows.uniform = int(counts[0])
            return rows, (0, 0)
        rids = list(gen_rids)
        new = resumed = 0
        timestamp = time.monotonic()
        self._computed[ctx] = out.context_starts  # what a new request's data carries
        ctx_reqs: list[Any] = self._req_of[ctx].tolist()
        ctx_kinds = np.zeros(len(ctx), np.int8)
        for i, (request, cached) in enumerate(zip(ctx_reqs, out.context_cached_lens.tolist())):
            rids.append(request.request_id)
            if request.status == RequestStatus.WAITING:
                ctx_kinds[i] = 1
                new += 1
                self._admit(request, cached, timestamp)
            elif request.status == RequestStatus.PREEMPTED:
                ctx_kinds[i] = 2
                resumed += 1
                self._admit(request, cached, timestamp)
        rows = _Rows(
            np.concatenate([gen, ctx]),
            rids,
            np.concatenate([counts, out.context_lens]),
            np.concatenate([out.generation_positions, out.context_starts]),
            np.concatenate([np.zeros(len(gen), np.int8), ctx_kinds]),
            len(gen),
            ctx_reqs,
            any_kind=bool(new or resumed),
            repeated=repeated,
        )
        return rows, (new, resumed)

    def _admit(self, request: Any, cached: int, timestamp: float) -> None:
        if self.log_stats:
            request.record_event(EngineCoreEventType.SCHEDULED, timestamp)
        if request.prefill_stats and request.num_preemptions <= 0:
            request.prefill_stats.set(
                num_prompt_tokens=request.num_prompt_tokens,
                num_local_cached_tokens=cached,
                num_external_cached_tokens=0,
            )
        request.status = RequestStatus.RUNNING

    def _spec_tokens(self, out: ScheduleOutput, rows: _Rows) -> dict[str, list[int]]:
        """The drafts each generation entry verifies (placeholders one step ahead, where the
        model runner fills them in)."""
        counts = out.generation_draft_counts
        if not self.num_spec_tokens or not len(counts) or not counts.any():
            return {}
        rows_drafted = np.flatnonzero(counts)
        rids = rows.rids
        if self._async:
            return {rids[i]: [-1] * int(counts[i]) for i in rows_drafted.tolist()}
        drafted = counts[rows_drafted]
        if len(rows_drafted) == len(counts):  # every decode verifies drafts
            names = rids[: len(counts)]
        else:
            names = [rids[i] for i in rows_drafted.tolist()]
        proposed = self._proposed
        if proposed is not None:
            hids, proposals, lengths = proposed
            if (
                len(hids) == len(drafted)
                and (hids == rows.hids[rows_drafted]).all()
                and (lengths == drafted).all()
            ):  # the drafter's lists, each verified whole, in the step's order
                return dict(zip(names, proposals))
            self._write_proposals()
        # helix verifies the first d drafts proposed (its generation_draft_tokens): the
        # request's own list when they are all of it
        lists: list[list[int]] = self._spec[rows.hids[rows_drafted]].tolist()
        whole = np.fromiter(map(len, lists), np.int64, len(lists)) == drafted
        if whole.all():
            return dict(zip(names, lists))
        return {
            rid: drafts if full else drafts[:d]
            for rid, drafts, full, d in zip(names, lists, whole.tolist(), drafted.tolist())
        }

    def _new_block_ids(self, rows: _Rows) -> list[tuple[list[int], ...] | None]:
        """Each row's new vLLM block ids (helix page + 1, block 0 being vLLM's null block):
        the blocks past what the model runner holds, the whole table for a new or resumed
        row; None where nothing is new."""
        hids = rows.hids
        if not len(hids):
            return []
        if not rows.any_kind and not self._tables_changed:
            growth = self.helix.grow_block_tables(hids, self._known)
            if growth is not None:  # (the common case) every table the runner's, or longer
                return self._grown_block_ids(hids, *growth)
        known = self._known[hids]
        starts = np.where(rows.kinds == 0, known, 0) if rows.any_kind else known
        pages, tails = self.helix.block_table_tails(hids, starts)
        skip: npt.NDArray[np.bool_] | None = None
        # a table shorter than the runner's, or one rejected drafts changed: read closer
        suspect = self._tables_changed or bool((tails < 0).any())
        if suspect:
            skip = self._regrown(hids, rows.kinds, pages, tails)
            if skip is None:  # a table changed under the runner: it goes whole, as resumed
                rows.any_kind = True
                starts = np.where(rows.kinds == 0, known, 0)
                pages, tails = self.helix.block_table_tails(hids, starts)
            self._replace[hids] = False
        self._known[hids] = starts + tails
        block_ids: list[tuple[list[int], ...] | None] = [None] * len(hids)
        grown = np.flatnonzero(tails > 0)
        if len(grown):
            ends = np.cumsum(tails[grown])
            self._last_page[hids[grown]] = pages[ends - 1]
            if suspect:
                self._stale[hids[grown]] = -1
            ids: list[int] = (pages + 1).tolist()
            firsts_at = ends - tails[grown]
            firsts = (firsts_at if skip is None else firsts_at + skip[grown]).tolist()
            for row, first, end in zip(grown.tolist(), firsts, ends.tolist()):
                if first < end:
                    block_ids[row] = (ids[first:end],)
        if suspect:
            self._tables_changed = bool(self._replace.any() or (self._stale >= 0).any())
        return block_ids

    def _grown_block_ids(
        self, hids: _Ids, pages: npt.NDArray[np.int32], grown: _Ids, tails: _Ids
    ) -> list[tuple[list[int], ...] | None]:
        """Each row's new vLLM block ids where no table changed under the runner: the
        pages of rows ``grown`` (``tails`` each), None elsewhere."""
        if not len(grown):
            return [None] * len(hids)
        ends = np.cumsum(tails)
        self._last_page[hids[grown]] = pages[ends - 1]
        ids: list[int] = (pages + 1).tolist()
        if len(ids) == len(grown) == len(hids):  # (lockstep decodes) one new block a row
            return [([block],) for block in ids]
        block_ids: list[tuple[list[int], ...] | None] = [None] * len(hids)
        if len(ids) == len(grown):  # one new block each
            for row, block in zip(grown.tolist(), ids):
                block_ids[row] = ([block],)
            return block_ids
        for row, first, end in zip(grown.tolist(), (ends - tails).tolist(), ends.tolist()):
            block_ids[row] = (ids[first:end],)
        return block_ids

    def _regrown(
        self,
        hids: _Ids,
        kinds: npt.NDArray[np.int8],
        pages: npt.NDArray[np.int32],
        tails: _Ids,
    ) -> npt.NDArray[np.bool_] | None:
        """Rows whose first new page is the one the runner still holds past the table's end
        (the page rejected drafts gave back, handed to the same request again): it is not
        new to the runner. None when some row's table changed otherwise (a table shorter
        than the runner's, or regrown with another page): those rows become resumed (kind
        2) and every table is read again."""
        skip = np.zeros(len(hids), np.bool_)
        changed = (kinds == 0) & ((tails < 0) | self._replace[hids])
        stale = np.flatnonzero((kinds == 0) & (tails > 0) & (self._stale[hids] >= 0))
        if len(stale):
            firsts = np.cumsum(np.maximum(tails, 0)) - np.maximum(tails, 0)
            same = pages[firsts[stale]] == self._stale[hids[stale]]
            skip[stale[same]] = True
            changed[stale[~same]] = True
        if not changed.any():
            return skip
        kinds[changed] = 2
        self._stale[hids[changed]] = -1
        return None

    def _split(
        self, rows: _Rows, block_ids: list[tuple[list[int], ...] | None], seq: int
    ) -> tuple[list[Any], Any]:
        """The rows as vLLM's new requests and cached requests, in the model runner's form:
        V1 reads a resumed request (a preempted one re-admitted, or one whose table helix
        replaced) as cached with its whole table, V2 as a new request with its tokens."""
        kinds = rows.kinds
        v2 = self.use_v2_model_runner
        new_rows = (
            np.flatnonzero(kinds != 0 if v2 else kinds == 1).tolist() if rows.any_kind else []
        )
        new_reqs = []
        for i in new_rows:
            request = rows.request(int(rows.hids[i]), i, self._req_of)
            new_reqs.append(
                NewRequestData.from_request(
                    request, block_ids[i], request._all_token_ids if v2 else None, uses_mrope=False
                )
            )
        outputs = self._num_output_tokens(rows)
        if not rows.any_kind:
            order: list[int] | None = None
            resumed: set[str] = set()
        else:
            cached_rows = [np.flatnonzero(kinds == 0)]
            if not v2:
                cached_rows.append(np.flatnonzero(kinds == 2))
            order = np.concatenate(cached_rows).tolist()
            resumed = {rows.rids[i] for i in order if kinds[i] == 2}
        all_token_ids = {} if v2 else self._all_token_ids(rows, seq)
        if order is None:
            req_ids, new_block_ids = rows.rids, block_ids
            computed, num_outputs = rows.computed.tolist(), outputs.tolist()
        else:
            req_ids = [rows.rids[i] for i in order]
            new_block_ids = [block_ids[i] for i in order]
            computed, num_outputs = rows.computed[order].tolist(), outputs[order].tolist()
        cached = CachedRequestData(
            req_ids=req_ids,
            resumed_req_ids=resumed,
            new_token_ids=[],
            all_token_ids=all_token_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=computed,
            num_output_tokens=num_outputs,
        )
        return new_reqs, cached

    def _num_output_tokens(self, rows: _Rows) -> _Ids:
        """vLLM's ``num_output_tokens + num_output_placeholders`` of each row before the step:
        a decode at position p has p + 1 tokens, the prompt's among them."""
        if rows.gen_prompts is not None and not rows.ctx_reqs:
            outputs = rows.computed - rows.gen_prompts
        else:
            outputs = rows.computed - self._prompt_len[rows.hids]
        outputs += 1
        for i, request in enumerate(rows.ctx_reqs, rows.num_generation):
            outputs[i] = request.num_output_tokens + request.num_output_placeholders
        return outputs

    def _all_token_ids(self, rows: _Rows, seq: int) -> dict[str, list[int]]:
        """V1's tokens of the cached requests the model runner may not hold: the ones not
        scheduled in the previous step (vLLM's own rule), and one step ahead every resumed
        one (the runner rebuilds a resumed request's outputs from them there; one step at
        a time it keeps its own, so a table replaced under a request that ran in the
        previous step sends none)."""
        kinds = rows.kinds
        if rows.repeated and not rows.any_kind and not rows.ctx_reqs:
            return {}  # every row ran in the previous step
        missing = self._last_scheduled[rows.hids] != seq - 1
        if rows.any_kind:
            missing &= kinds != 1  # (a new request's tokens go in its own data)
            if self._async:
                missing |= kinds == 2
        if not missing.any():
            return {}
        hids = rows.hids.tolist()
        return {
            rows.rids[i]: rows.request(hids[i], i, self._req_of).all_token_ids.copy()
            for i in np.flatnonzero(missing).tolist()
        }

    def _make_output(
        self,
        rows: _Rows,
        new_reqs: list[Any],
        cached: Any,
        spec_tokens: dict[str, list[int]],
        block_ids: list[tuple[list[int], ...] | None],
    ) -> Any:
        if not isinstance(cached, CachedRequestData):
            cached = CachedRequestData.make_empty()
        counts = rows.counts
        if rows.uniform:  # as many tokens each: the cheapest
            total = rows.uniform * len(counts)
            scheduled = dict.fromkeys(rows.rids, rows.uniform)
        else:
            total = int(counts.sum())
            scheduled = dict(zip(rows.rids, counts.tolist()))
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=spec_tokens,
            scheduled_encoder_inputs={},
            finished_req_ids=self._finished_ids,
            free_encoder_mm_hashes=[],
            preempted_req_ids=self._preempted_ids,
            num_spec_tokens_to_schedule=self.num_spec_tokens,
        )
        self._finished_ids = set()
        self._preempted_ids = set()
        return output

    def _after_schedule(self, out: ScheduleOutput, rows: _Rows, seq: int) -> None:
        """vLLM's lockstep after a schedule, written for the whole step at once: computed
        tokens count the scheduled ones (rejected drafts are given back at update), the
        drafts a request verifies are in the output (the next ones come later); one step
        ahead, the tokens in flight are output placeholders."""
        hids = rows.hids
        self._computed[hids] = rows.computed + rows.counts
        if self.num_spec_tokens and not self._async:
            proposed = self._proposed
            if proposed is not None and not _subset(proposed[0], hids):
                self._write_proposals()  # a request not scheduled keeps its drafts
            self._proposed = None
            self._spec[hids] = None
        if rows.ctx_reqs:
            self._chunk[hids[rows.num_generation :]] = ~out.context_completes
        if self._async:
            self._add_placeholders(out, rows)
        self._last_scheduled[hids] = seq

    def _add_placeholders(self, out: ScheduleOutput, rows: _Rows) -> None:
        """AsyncScheduler's placeholders: each sampling row's token (and drafts) in flight."""
        g = rows.num_generation
        placeholders = [-1] * self.num_spec_tokens
        sampling = self._req_of[rows.hids[:g]].tolist() + [
            rows.ctx_reqs[i] for i in np.flatnonzero(out.context_completes).tolist()
        ]
        counts = rows.counts[:g].tolist() + [1] * (len(sampling) - g)
        for request, count in zip(sampling, counts):
            request.num_output_placeholders += count
            if placeholders:
                request.spec_token_ids = placeholders

    def _propose_placeholders(self) -> None:
        """One step ahead the model runner drafts on the device: helix is proposed
        ``num_speculative_tokens`` placeholders for every request holding KV, and decides
        which decodes verify them (not one whose drafts of the pending step are unverified)."""
        ids, held, aborting = self.helix.queue_holdings()
        ids = ids[(held > 0) & ~aborting]
        k = self.num_spec_tokens
        self.helix.propose_drafts(
            ids, np.full(len(ids), k, np.int64), np.full(len(ids) * k, -1, np.int32)
        )

    # -- update ----------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """Closes the oldest pending step with the model runner's tokens: vLLM's stop check
        on each sampled token, helix's update with the tokens and the stops, one
        ``EngineCoreOutput`` per request with new tokens; returns them by client."""
        step = self._pop_step(scheduler_output)
        outputs: defaultdict[int, list[Any]] = defaultdict(list)
        spec_stats = None
        if step.helix is not None:
            spec_stats = self._close(step, model_runner_output, outputs)
        for request, _ in self._rejected:
            self._finish_in_error(request, outputs)
        self._rejected = []
        self._close_empty_steps()
        return self._engine_outputs(outputs, spec_stats)

    def _pop_step(self, scheduler_output: Any) -> _Step:
        if self._pending and self._pending[0].output is scheduler_output:
            return self._pending.popleft()
        if not scheduler_output.total_num_scheduled_tokens:  # closed when scheduled
            return _Step.unscheduled(scheduler_output)
        raise ValueError(
            "update_from_output() must close the oldest pending schedule() output, "
            f"in order ({len(self._pending)} pending)"
        )

    def _close(self, step: _Step, runner: Any, outputs: defaultdict[int, list[Any]]) -> Any:
        """Applies the step's tokens to vLLM's requests and to helix."""
        accepted: _Ids | None = None
        spec_stats = None
        if step.drafts is None:
            tokens, eos, lazy = self._apply_tokens(step, runner, outputs)
        else:
            tokens, eos, accepted, spec_stats, lazy = self._apply_drafts(step, runner, outputs)
        released, self._retired = self._retired, []
        finished = self.helix.update(tokens, eos, accepted)
        if lazy is not None:  # tokens helix now holds, not yet in vLLM's lists
            self._ntokens[lazy[0]] = lazy[1]
        # Ids retired before this update: no pending step holds them any more.
        self._free.extend(released)
        for hid in finished.tolist():
            self._finish(hid, outputs)
        if step.drafted_hids is not None:
            returned = self.helix.metrics().spec_decode_returned_superblocks
            if returned != self._returned:  # rejected drafts gave superblocks back
                self._returned = returned
                self._note_shrunk_tables(step.drafted_hids)
        self._stats.admitted(*step.admissions)
        return spec_stats

    def _finish(self, hid: int, outputs: defaultdict[int, list[Any]]) -> None:
        """A request helix finished: stopped by vLLM's check (or aborted) in this update."""
        request = self._req_of[hid]
        if self._hid_of.get(request.request_id) == hid:  # not finished from outside
            if not request.is_finished():  # helix's length cap is vLLM's: never here
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                outputs[request.client_index].append(
                    EngineCoreOutput(
                        request_id=request.request_id,
                        new_token_ids=[],
                        finish_reason=request.get_finished_reason(),
                    )
                )
            self._note_finished(request)
        self._retire(hid)

    def _note_shrunk_tables(self, hids: _Ids) -> None:
        """Tables rejected drafts made shorter: the model runner appends to its copy, so it
        keeps the page given back past the new end. One page (drafts reach one superblock
        at most, unless they are many) is remembered: if the same request gets it back, the
        runner's copy is right again; otherwise the table goes to it whole (as resumed) the
        next time it is scheduled."""
        hids = hids[self._alive[hids]]  # not retired in this update
        if not len(hids):
            return
        _, tails = self.helix.block_table_tails(hids, self._known[hids])
        shrunk = tails < 0
        if not shrunk.any():
            return
        hids, tails = hids[shrunk], tails[shrunk]
        one = (tails == -1) & (self._stale[hids] < 0) & (self._last_page[hids] >= 0)
        self._stale[hids[one]] = self._last_page[hids[one]]
        self._last_page[hids] = -1
        self._known[hids] += tails
        self._replace[hids[~one]] = True
        self._tables_changed = True

    def _apply_tokens(
        self, step: _Step, runner: Any, outputs: defaultdict[int, list[Any]]
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_] | None, _Lazy | None]:
        """One token per sample row (no drafts): appended, stop-checked, reported."""
        tokens: list[int] = []
        stops: list[int] = []
        extras = _Extras.of(runner, self._return_sampling_mask)
        head = np.zeros(0, np.int32)
        lazy = None
        reqs = step.ctx_reqs
        first = len(step.gen_hids)
        if extras is None and not self._unusual and not self._async:
            batch = self._decode_batch(step, runner, outputs)
            if batch is None:
                gen_reqs = step.gen_reqs(self._req_of)
                self._decode_outputs(gen_reqs, runner, outputs, tokens, stops)
            else:
                head, stops, lazy = batch
        else:
            reqs, first = step.sample_reqs(self._req_of), 0
        sampled = runner.sampled_token_ids
        index = runner.req_id_to_index
        preempted = RequestStatus.PREEMPTED
        running = RequestStatus.RUNNING
        for row, request in enumerate(reqs, first):
            status = RequestStatus.FINISHED_ABORTED if request is None else request.status
            if status > preempted:  # finished meanwhile (an abort): helix drops its token
                tokens.append(0)
                continue
            j = index.get(request.request_id)
            new = sampled[j] if j is not None and sampled else None
            if not new:
                tokens.append(0)
                self._fail_unsampled(request, outputs)
                continue
            tokens.append(new[0])
            request.append_output_token_ids(new[0])
            if self._async and status == running:
                request.num_output_placeholders -= 1
            stopped = check_stop(request, self.max_model_len)
            if stopped:
                stops.append(row)
            outputs[request.client_index].append(self._output(request, new, stopped, j, extras))
        rest = np.asarray(tokens, dtype=np.int32) if tokens else None
        all_tokens = head if rest is None else np.concatenate([head, rest])
        eos = None
        if stops:
            eos = np.zeros(len(all_tokens), np.bool_)
            eos[stops] = True
        return all_tokens, eos, lazy

    def _decode_batch(
        self, step: _Step, runner: Any, outputs: defaultdict[int, list[Any]]
    ) -> tuple[npt.NDArray[np.int32], list[int], _Lazy] | None:
        """The decodes' tokens in one pass over arrays, in the common case (one step at a
        time, one client, no trace headers, nothing else from the runner): vLLM's stop check
        runs on the rows the stop filter flags, each appending its token first; every other
        decode's output is its token, and its lists get it when read (``_vllm_lockstep``).
        Returns the tokens, the rows that stopped and the rows whose lists lack their token;
        None when a row needs the per-row path (finished meanwhile, or no token sampled)."""
        hids, rids = step.gen_hids, step.gen_rids
        g = len(hids)
        if not g:
            return np.zeros(0, np.int32), [], (hids, hids)
        if self._ended_live and self._ended[hids].any():
            return None
        news = _sampled_lists(runner, rids)
        if news is None:
            return None
        tokens, counts = flatten_token_lists(news)
        if len(tokens) != g or not counts.all():  # a decode the runner sampled nothing for
            return None
        totals = self._ntokens[hids]
        totals += 1
        flagged = self._stops.candidates(hids, tokens, None, totals)
        if not flagged.any():
            outputs[0].extend(map(EngineCoreOutput, rids, news))
            return tokens, [], (hids, totals)
        keep = ~flagged
        outputs[0].extend(map(EngineCoreOutput, compress(rids, keep), compress(news, keep)))
        stops: list[int] = []
        emit = outputs[0].append
        rows = np.flatnonzero(flagged)
        for row, request in zip(rows.tolist(), step.gen_reqs(self._req_of, rows)):
            new = news[row]
            request.append_output_token_ids(new[0])
            if check_stop(request, self.max_model_len):
                stops.append(row)
                emit(self._output(request, new, True, row, None))
            else:
                emit(EngineCoreOutput(request_id=request.request_id, new_token_ids=new))
        return tokens, stops, (hids[keep], totals[keep])

    def _decode_outputs(
        self,
        reqs: list[Any],
        runner: Any,
        outputs: defaultdict[int, list[Any]],
        tokens: list[int],
        stops: list[int],
    ) -> None:
        """The decodes' tokens in the common case (one step at a time, one client, no trace
        headers, nothing else from the runner): a decode has no event and no prefill
        statistics, so its output is its token, or the full one when it stops."""
        sampled = runner.sampled_token_ids
        index = runner.req_id_to_index
        preempted = RequestStatus.PREEMPTED
        max_model_len = self.max_model_len
        emit = outputs[0].append
        for row, request in enumerate(reqs):
            if request is None or request.status > preempted:  # finished meanwhile
                tokens.append(0)
                continue
            rid = request.request_id
            j = index.get(rid)
            new = sampled[j] if j is not None else None
            if not new:
                tokens.append(0)
                self._fail_unsampled(request, outputs)
                continue
            token = new[0]
            tokens.append(token)
            request.append_output_token_ids(token)
            if check_stop(request, max_model_len):
                stops.append(row)
                emit(self._output(request, new, True, j, None))
            else:
                emit(EngineCoreOutput(request_id=rid, new_token_ids=new))

    def _output(
        self, request: Any, new: list[int], stopped: bool, index: int, extras: _Extras | None
    ) -> Any:
        """The request's ``EngineCoreOutput`` of this step."""
        prefill_stats = request.prefill_stats
        if prefill_stats is not None:
            request.prefill_stats = None
            prefill_stats.finalize(self._cached_estimate(request))
        events = request.events
        if events:
            request.events = []
        else:
            events = None
        finish_reason = request.get_finished_reason() if stopped else None
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new,
            finish_reason=finish_reason,
            stop_reason=request.stop_reason,
            events=events,
            prefill_stats=prefill_stats,
            trace_headers=request.trace_headers,
            num_nans_in_logits=request.num_nans_in_logits,
            spec_decode_metrics=request.spec_decode_metrics if stopped else None,
        )
        if extras is not None:
            extras.attach(output, request, index, len(new))
        return output

    def _cached_estimate(self, request: Any) -> int:
        """vLLM's ``estimate_cached_tokens`` as a prompt completes: its full blocks, which
        helix registers in the prefix cache as they complete."""
        if not self._caching:
            return 0
        return (int(request.num_prompt_tokens) // self.block_size) * self.block_size

    def _fail_unsampled(self, request: Any, outputs: defaultdict[int, list[Any]]) -> None:
        """A sampling row the model runner gave no token: helix cannot close the request's
        step without one, so the request ends in error (through vLLM's error path)."""
        logger.error("the model runner sampled no token for request %s", request.request_id)
        hid = self._hid_of.pop(request.request_id)
        self._ids_version += 1
        self.helix.abort(hid)
        self._finish_in_error(request, outputs)

    def _apply_drafts(
        self, step: _Step, runner: Any, outputs: defaultdict[int, list[Any]]
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_] | None, _Ids, Any, _Lazy | None]:
        """A step whose decodes verify drafts: a generation entry has ``1 + drafts`` rows and
        keeps its accepted tokens (the model runner's list: accepted drafts, then one);
        rejected drafts were not computed after all."""
        assert step.drafts is not None
        drafts: list[int] = step.drafts.tolist()
        g = len(drafts)
        tokens = np.zeros(sum(drafts) + g + len(step.ctx_reqs), np.int32)
        accepted = np.zeros(g, np.int64)
        stops: list[int] = []
        sampled = runner.sampled_token_ids
        index = runner.req_id_to_index
        extras = _Extras.of(runner, self._return_sampling_mask)
        verify = _Verify(self, step.output.num_invalid_spec_tokens or {})
        lazy = None
        if extras is None and not self._unusual and not self._async:
            lazy = self._verify_batch(step, runner, outputs, tokens, accepted, stops, verify)
            if lazy is None:
                verify.stats = self._verify_outputs(
                    step.gen_reqs(self._req_of),
                    drafts,
                    runner,
                    outputs,
                    tokens,
                    accepted,
                    stops,
                    verify,
                )
            reqs, start, row = step.ctx_reqs, g, g + sum(drafts)
        else:
            reqs, start, row = step.sample_reqs(self._req_of), 0, 0
        running = RequestStatus.RUNNING
        max_model_len = self.max_model_len
        for i, request in enumerate(reqs, start):
            width = drafts[i] + 1 if i < g else 1
            first = row
            row += width
            status = RequestStatus.FINISHED_ABORTED if request is None else request.status
            if status > RequestStatus.PREEMPTED:  # finished meanwhile
                continue
            j = index.get(request.request_id)
            new = sampled[j] if j is not None and sampled else None
            if not new:
                self._fail_unsampled(request, outputs)
                continue
            n = len(new)
            if n > width:
                new = new[:width]
                n = width
            tokens[first : first + n] = new
            live = status == running
            if i < g and width > 1:
                accepted[i] = n - 1
                verify.verified(request, width - 1, n - 1, live)
            append = request.append_output_token_ids
            stopped = False
            for kept, token in enumerate(new, 1):
                append(token)
                if check_stop(request, max_model_len):
                    del new[kept:]
                    stopped = True
                    stops.append(first + kept - 1)
                    break
            if self._async and live:
                request.num_output_placeholders -= len(new)
            outputs[request.client_index].append(self._output(request, new, stopped, j, extras))
        eos = None
        if stops:
            eos = np.zeros(len(tokens), np.bool_)
            eos[stops] = True
        return tokens, eos, accepted, verify.stats, lazy

    def _verify_batch(
        self,
        step: _Step,
        runner: Any,
        outputs: defaultdict[int, list[Any]],
        tokens: npt.NDArray[np.int32],
        accepted: _Ids,
        stops: list[int],
        verify: _Verify,
    ) -> _Lazy | None:
        """The decodes' verifications in one pass over arrays (the common case, as
        :meth:`_decode_batch`): each keeps its accepted tokens; rows the stop filter flags
        go through vLLM's stop check token by token. Returns the rows whose lists lack
        their tokens, and each one's token count with them; None when a row needs the
        per-row path."""
        hids, rids, drafts = step.gen_hids, step.gen_rids, step.drafts
        assert drafts is not None
        if (self._ended_live and self._ended[hids].any()) or verify.invalid or verify.per_request:
            return None
        news = _sampled_lists(runner, rids)
        if news is None:
            return None
        flat, kept = flatten_token_lists(news)
        rejected = drafts + 1 - kept
        if not kept.all() or (rejected < 0).any():
            return None
        # each entry's kept tokens at the start of its 1 + drafts rows
        ends = np.cumsum(drafts + 1)
        gaps = ends - np.cumsum(kept)
        tokens[np.arange(len(flat)) + np.repeat(gaps - rejected, kept)] = flat
        accepted[:] = kept - 1
        totals = self._ntokens[hids] + kept
        flagged = self._stops.candidates(hids, flat, kept, totals)
        if flagged.any():
            keep = ~flagged
            outputs[0].extend(map(EngineCoreOutput, compress(rids, keep), compress(news, keep)))
            rows = np.flatnonzero(flagged)
            self._verify_flagged(step, rows, news, ends - drafts - 1, outputs, stops, verify)
            hids, drafts, kept, rejected = hids[keep], drafts[keep], kept[keep], rejected[keep]
            totals = totals[keep]
        else:
            outputs[0].extend(map(EngineCoreOutput, rids, news))
        # rejected drafts were not computed after all
        self._computed[hids] -= rejected
        verify.observe_many(drafts, kept - 1)
        return hids, totals

    def _verify_flagged(
        self,
        step: _Step,
        rows: _Ids,
        news: list[list[int]],
        firsts: _Ids,
        outputs: defaultdict[int, list[Any]],
        stops: list[int],
        verify: _Verify,
    ) -> None:
        """The verified rows the stop filter flagged: their tokens appended one by one, each
        through vLLM's stop check (the tokens after a stop are dropped)."""
        assert step.drafts is not None
        emit = outputs[0].append
        drafts = step.drafts[rows].tolist()
        reqs = step.gen_reqs(self._req_of, rows)
        for row, request, d, first in zip(rows.tolist(), reqs, drafts, firsts[rows].tolist()):
            new = news[row]
            if d:
                verify.verified(request, d, len(new) - 1, True)
            append = request.append_output_token_ids
            for kept, token in enumerate(new, 1):
                append(token)
                if check_stop(request, self.max_model_len):
                    del new[kept:]
                    stops.append(first + kept - 1)
                    emit(self._output(request, new, True, row, None))
                    break
            else:
                emit(EngineCoreOutput(request_id=request.request_id, new_token_ids=new))

    def _verify_outputs(
        self,
        reqs: list[Any],
        drafts: list[int],
        runner: Any,
        outputs: defaultdict[int, list[Any]],
        tokens: npt.NDArray[np.int32],
        accepted: _Ids,
        stops: list[int],
        verify: _Verify,
    ) -> Any:
        """The decodes' verifications in the common case (one step at a time, one client,
        no trace headers, nothing else from the runner): each keeps its accepted tokens up
        to vLLM's stop check; returns the step's spec-decode statistics (None without any)."""
        sampled = runner.sampled_token_ids
        index = runner.req_id_to_index
        preempted = RequestStatus.PREEMPTED
        max_model_len = self.max_model_len
        emit = outputs[0].append
        invalid = verify.invalid
        log = self.log_stats
        stats = verify.stats
        row = 0
        for i, (request, d) in enumerate(zip(reqs, drafts)):
            first = row
            row += d + 1
            if request is None or request.status > preempted:  # finished meanwhile
                continue
            rid = request.request_id
            j = index.get(rid)
            new = sampled[j] if j is not None else None
            if not new:
                self._fail_unsampled(request, outputs)
                continue
            n = len(new)
            if n > d + 1:
                new, n = new[: d + 1], d + 1
            tokens[first : first + n] = new
            if d:
                accepted[i] = n - 1
                request.num_computed_tokens -= d + 1 - n
                counted = d - invalid.get(rid, 0) if invalid else d
                if log and counted:
                    if stats is None:
                        stats = SpecDecodingStats.new(self.num_spec_tokens)
                    stats.observe_draft(counted, n - 1)
                if request.spec_decode_metrics is not None:
                    verify.observe_request(request, counted, n - 1)
            append = request.append_output_token_ids
            for kept, token in enumerate(new, 1):
                append(token)
                if check_stop(request, max_model_len):
                    del new[kept:]
                    stops.append(first + kept - 1)
                    emit(self._output(request, new, True, j, None))
                    break
            else:
                emit(EngineCoreOutput(request_id=rid, new_token_ids=new))
        return stats

    def _engine_outputs(self, outputs: defaultdict[int, list[Any]], spec_stats: Any) -> Any:
        """The step's outputs by client, with the finished ids and the scheduler stats."""
        engine = {client: EngineCoreOutputs(outputs=outs) for client, outs in outputs.items()}
        by_client = self._finished_by_client
        if by_client:
            for client, finished in by_client.items():
                if (eco := engine.get(client)) is not None:
                    eco.finished_requests = finished
                else:
                    engine[client] = EngineCoreOutputs(finished_requests=finished)
            by_client.clear()
        stats = self.make_stats(spec_stats)
        if stats is not None:
            if (eco := next(iter(engine.values()), None)) is None:
                engine[0] = eco = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return engine

    def make_stats(
        self,
        spec_decoding_stats: Any = None,
        kv_connector_stats: Any = None,
        cudagraph_stats: Any = None,
        perf_stats: Any = None,
        ec_connector_stats: Any = None,
    ) -> Any:
        """vLLM's ``SchedulerStats`` from helix's state and counters: running and waiting
        requests, KV use (cached superblocks nobody references count as free, as vLLM's
        free queue holds them), the prefix-cache lookups of the steps that ran since the
        last call, and the step's spec-decode verifications."""
        if not self.log_stats:
            return None
        metrics = self.helix.metrics()
        running, waiting = self.get_request_counts()
        return SchedulerStats(
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            kv_cache_usage=float(metrics.kv_utilization),
            prefix_cache_stats=self._stats.take(metrics),
            spec_decoding_stats=spec_decoding_stats,
            cudagraph_stats=cudagraph_stats,
            perf_stats=perf_stats,
        )

    # -- drafts ----------------------------------------------------------------------------

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """The drafter's proposals for the next step, handed to helix, which decides how
        many of them each decode verifies (drafts take free pages only, last)."""
        hid_of = self._hid_of
        ids = draft_token_ids.req_ids
        # the drafter names the same requests step after step: their ids are looked up once
        cached_ids, cached_version, found = self._draft_ids
        if cached_version != self._ids_version or ids != cached_ids:
            found = np.fromiter((hid_of.get(rid, -1) for rid in ids), np.int64, len(ids))
            self._draft_ids = (list(ids), self._ids_version, found)
        proposals = list(draft_token_ids.draft_token_ids)
        if (found < 0).any():  # finished meanwhile
            proposals = [d for d, hid in zip(proposals, found.tolist()) if hid >= 0]
            found = found[found >= 0]
        flat, counts = flatten_token_lists(proposals)
        # vLLM ignores drafts for prefill chunks; the GPU n-gram drafter pads with -1
        limit = self.num_spec_tokens
        if self._chunk.any() or (len(flat) and (flat.min() < 0 or counts.max() > limit)):
            self._clean_proposals(found, proposals, flat, counts)
        # helix decides on the counts, given placeholders; the lists are the requests'
        # spec_token_ids (``_vllm_lockstep``), which go to the model runner
        # (``scheduled_spec_decode_tokens``), kept as the drafter made them until read
        self.helix.propose_drafts(found, counts, np.full(int(counts.sum()), -1, np.int32))
        if self._proposed is not None:
            self._write_proposals()
        self._proposed = (found, proposals, counts)

    def _write_proposals(self) -> None:
        """The drafter's last proposals into the requests' ``spec_token_ids``."""
        if self._proposed is not None:
            found, proposals, _ = self._proposed
            self._proposed = None
            self._spec[found] = np.fromiter(proposals, object, len(found))

    def _clean_proposals(
        self, found: _Ids, proposals: list[list[int]], flat: npt.NDArray[np.int32], counts: _Ids
    ) -> None:
        """The proposals of prefill chunks emptied, padded ones stripped, each cut to
        ``num_speculative_tokens`` (in place, with their counts)."""
        odd = self._chunk[found] | (counts > self.num_spec_tokens)
        if len(flat):
            ends = np.cumsum(counts)
            odd[counts > 0] |= flat[ends[counts > 0] - 1] < 0
        if odd.any():
            for i in np.flatnonzero(odd).tolist():
                drafts = proposals[i]
                if self._chunk[found[i]]:
                    drafts = []
                else:
                    drafts = strip_speculative_padding(drafts)[: self.num_spec_tokens]
                proposals[i] = drafts
                counts[i] = len(drafts)

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any) -> None:
        """One step ahead the drafts fill the placeholders of the step already scheduled
        (cut to the drafts it verifies; no grammar to check them against)."""
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        for request_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            placeholders = scheduled.get(request_id)
            if placeholders:
                scheduled[request_id] = list(drafts[: len(placeholders)])


class _Verify:
    """vLLM's view of a step's verifications: rejected drafts were not computed after all;
    the spec-decode statistics count the drafts (less those a grammar invalidated)."""

    def __init__(self, scheduler: HelixScheduler, invalid: dict[str, int]) -> None:
        self._async = scheduler._async
        self._num_spec = scheduler.num_spec_tokens
        self._log = scheduler.log_stats
        self._detailed = scheduler.spec_decode_metrics_level == "detailed"
        #: whether each request keeps its own acceptance record
        self.per_request = scheduler.spec_decode_metrics_level != "none"
        self.invalid = invalid
        self.stats: Any = None

    def observe_many(self, drafts: _Ids, accepted: _Ids) -> None:
        """The statistics of many verifications at once (drafts none invalidated, no
        per-request record): what ``observe_draft`` adds for each, summed."""
        if not self._log or not len(drafts):
            return
        k = self._num_spec
        by_drafts = np.bincount(drafts, minlength=k + 1)
        if by_drafts[0]:  # a decode without drafts verifies nothing
            verified = drafts > 0
            drafts, accepted = drafts[verified], accepted[verified]
            by_drafts[0] = 0
        if not len(drafts):
            return
        if self.stats is None:
            self.stats = SpecDecodingStats.new(k)
        stats = self.stats
        stats.num_drafts += len(drafts)
        stats.num_draft_tokens += int(drafts.sum())
        stats.num_accepted_tokens += int(accepted.sum())
        for name, counts in (
            ("num_accepted_tokens_per_pos", np.bincount(accepted, minlength=k + 1)),
            ("num_draft_tokens_per_pos", by_drafts),
        ):
            # position i counts the verifications with more than i of them
            above = counts[::-1].cumsum()[::-1][1 : k + 1].tolist()
            setattr(stats, name, [a + b for a, b in zip(getattr(stats, name), above)])

    def verified(self, request: Any, drafts: int, accepted: int, live: bool) -> None:
        if live:  # a request preempted meanwhile restarts from nothing anyway
            request.num_computed_tokens -= drafts - accepted
            if self._async:
                request.num_output_placeholders -= drafts - accepted
        counted = drafts - self.invalid.get(request.request_id, 0) if self.invalid else drafts
        if self._log and counted:
            if self.stats is None:
                self.stats = SpecDecodingStats.new(self._num_spec)
            self.stats.observe_draft(counted, accepted)
        if request.spec_decode_metrics is not None:
            self.observe_request(request, counted, accepted)

    def observe_request(self, request: Any, drafts: int, accepted: int) -> None:
        """The request's own acceptance record (``per_request_spec_decode_metrics``)."""
        request.spec_decode_metrics.observe(
            num_draft_tokens=drafts, num_accepted=accepted, detailed=self._detailed
        )


class _Extras:
    """The model runner's optional outputs of a step (logprobs, prompt logprobs, NaN
    counts, sampling masks), attached to each request's output; None when it has none."""

    def __init__(self, runner: Any, sampling_masks: bool) -> None:
        self.logprobs = runner.logprobs
        self.prompt_logprobs = runner.prompt_logprobs_dict or {}
        self.prompt_token_id_logprobs = runner.prompt_token_id_logprobs_dict or {}
        self.nans = runner.num_nans_in_logits or {}
        self.masks = runner.sampling_masks if sampling_masks else None

    @classmethod
    def of(cls, runner: Any, sampling_masks: bool) -> _Extras | None:
        extras = cls(runner, sampling_masks)
        if (
            extras.logprobs is None
            and not extras.prompt_logprobs
            and not extras.prompt_token_id_logprobs
            and not extras.nans
            and extras.masks is None
        ):
            return None
        return extras

    def attach(self, output: Any, request: Any, index: int, num_new: int) -> None:
        request_id = request.request_id
        if self.logprobs is not None and request.sampling_params.num_logprobs is not None:
            output.new_logprobs = self.logprobs.slice_request(index, num_new)
        if self.masks is not None:
            output.new_sampling_mask = self.masks.slice_request(index, num_new)
        output.new_prompt_logprobs_tensors = self.prompt_logprobs.get(request_id)
        output.prompt_token_id_logprobs = self.prompt_token_id_logprobs.get(request_id)
        if request_id in self.nans:
            request.num_nans_in_logits = self.nans[request_id]
            output.num_nans_in_logits = request.num_nans_in_logits


class _StatsBase:
    """vLLM's per-step prefix-cache statistics from helix's running totals: each call takes
    what the steps that ran added since the previous one."""

    def __init__(self, helix: Scheduler) -> None:
        metrics = helix.metrics()
        self._last = _prefix_totals(metrics)
        self.reset = False
        self._requests = 0
        self._preempted_requests = 0

    def admitted(self, new: int, resumed: int) -> None:
        self._requests += new
        self._preempted_requests += resumed

    def take(self, metrics: Any) -> Any:
        totals = _prefix_totals(metrics)
        last = self._last
        queries, hits = totals[0] - last[0], totals[1] - last[1]
        preempted_queries, preempted_hits = totals[2] - last[2], totals[3] - last[3]
        enabled = queries or preempted_queries
        stats = PrefixCacheStats(
            reset=self.reset,
            requests=self._requests if enabled else 0,
            queries=queries,
            hits=hits,
            preempted_requests=self._preempted_requests if enabled else 0,
            preempted_queries=preempted_queries,
            preempted_hits=preempted_hits,
        )
        self._last = totals
        self.reset = False
        self._requests = self._preempted_requests = 0
        return stats


def _sampled_lists(runner: Any, rids: list[str]) -> list[list[int]] | None:
    """The model runner's sampled lists of requests ``rids``, in that order; None when it
    has none for one of them."""
    sampled: list[list[int]] = runner.sampled_token_ids
    req_ids: list[str] = runner.req_ids
    n = len(rids)
    if req_ids[:n] == rids and len(sampled) >= n:  # the runner's rows in the same order
        return sampled if len(sampled) == n else sampled[:n]
    rows = np.fromiter(map(runner.req_id_to_index.get, rids, repeat(-1)), np.int64, n)
    if not sampled or (rows < 0).any():
        return None
    return [sampled[j] for j in rows.tolist()]


def _subset(ids: _Ids, of: _Ids) -> bool:
    """Whether every id of ``ids`` is in ``of`` (the same array, in the common case)."""
    if len(ids) == len(of) and (ids == of).all():
        return True
    return bool(np.isin(ids, of).all())


def _prefix_totals(metrics: Any) -> tuple[int, int, int, int]:
    return (
        int(metrics.prefix_cache_queries),
        int(metrics.prefix_cache_hits),
        int(metrics.prefix_cache_recompute_queries),
        int(metrics.prefix_cache_recompute_hits),
    )
