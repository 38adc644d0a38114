"""Drives a :class:`helix_kv.SimulatedCPGroup` like an executor would, through the binding.

Each rank has a physical KV pool (numpy) written through the scheduler's ``slot_mapping`` and
read back through its ``block_table``; a deterministic "model" samples the next token from
the whole context it reads back (a CRC of the request id and every token). A schedule that
feeds a wrong token, position or page changes every later token, so comparing outputs with a
run without pressure checks replay end to end. Every step also checks replay directly
(re-prefill tokens are prompt + tokens generated so far; decode positions continue from the
new prompt end), that victims are strictly behind the request that needed their pages, that
each such request is served in the step that preempted for it (no futile preemption), and
that a victim goes past ``max_preemptions_per_request`` only for the queue head.

The pools are a **KV-content model**: every slot of every rank (and of its host tier) holds
the request, position and token whose KV the executor wrote there, a digest of what that KV
depends on (the request's cache salt and its tokens up to the position, drafts included) and
whether it is valid, or is unknown (a reverted step's copy-in may or may not have overwritten
it). Writes go through the slot mappings of steps that ran; copies to and from the host tier
copy slots; a reverted step makes its copy-outs, and its copy-ins as ``reverted_copy_ins`` says
(``"done"``, ``"not_done"``, or ``"either"``: the slots become unknown); a draft the verifier
rejected is marked not valid when its step completes. A step's writes land entry by entry,
context entries first, and every prefix-cache hit is read back just before its own entry's
writes: it may read KV of steps that ran and of the step's earlier context entries (same-step
sharing: the executor writes each layer's KV before that layer's attention), never of its own
entry, a later one or a decode of the step. Every chunk's context is read after the step's
writes and every sampled row's context as it is sampled, each slot checked against the
reader's salt and tokens (and, without prefix caching, its own request).

The executor drives the group through :class:`helix_kv.StepDriver`. With ``overlap=True`` it
runs one step ahead, as an overlapping engine does (step t+1 is scheduled and run before step t
is updated); the outputs must be those of the plain run. One step ahead, ``fail_every`` makes a
step fail on the device: its copies are made, its KV writes are not, the step planned after it
is scheduled and reverted, then it (both pending steps reverted, newest first).

Requests may be aborted (:attr:`Spec.abort_step`): between steps or while a step is pending,
optionally only once seen in a given state. Aborted outputs must be the start of the output
the request would have had, and nothing may be left behind (pages, host tier, slots).

With ``drafts=k`` (a config with ``num_speculative_tokens >= k``) it also speculates: before
each step it proposes up to ``k`` drafts for every decoding request (a seeded mix of the
model's true continuation and wrong tokens), writes the KV of every query position through the
slot mapping, samples the model at each one from the context read back (the drafts before it
included), accepts the longest prefix of drafts the model agrees with (greedy) and updates with
every row and the accepted counts. Greedy verification is exact, so the outputs must still be
the reference's.

The scheduler's rules are tested once, in Rust, by the same kind of group
(``rust/core/tests/common/mod.rs``); this executor is the Python side's integration test: a
pressured :class:`helix_kv.SimulatedCPGroup` run through every array the binding hands out
(``tests/test_cpgroup.py``). Prompts are the simulator's
(:func:`helix_kv.simulate.tokens.prompt_tokens`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

import helix_kv
from helix_kv.simulate.tokens import prompt_tokens


@dataclass(frozen=True)
class Spec:
    """One request of a workload."""

    request_id: int
    prompt_len: int
    max_new_tokens: int
    priority: int = 0
    arrival_step: int = 0
    #: Abort it once step ``abort_step`` comes (``None``: never): before that step is
    #: scheduled, or (``abort_pending``) while it is pending; with ``abort_state``, only once
    #: it is seen in that state (a label of :meth:`Executor.state_label`).
    abort_step: int | None = None
    abort_pending: bool = False
    abort_state: str | None = None
    #: Tokens of a system prompt every request with this field shares, before its own
    #: ``prompt_len`` (for prefix caching).
    shared_prefix: int = 0
    #: Its own tokens are those of request ``twin_of`` (the same prompt, for prefix caching).
    twin_of: int | None = None
    #: Its cache salt: prefix caching shares KV only between requests of the same salt.
    cache_salt: str | None = None

    def prompt(self) -> np.ndarray:
        own = prompt_tokens(
            self.request_id if self.twin_of is None else self.twin_of, self.prompt_len
        )
        if not self.shared_prefix:
            return own
        return np.concatenate([prompt_tokens(SYSTEM_PROMPT_ID, self.shared_prefix), own])


#: The request id whose prompt tokens are the shared system prompt (no request uses it).
SYSTEM_PROMPT_ID = 2**40

#: Owners of a pool slot that holds no request's KV: never written, or unknown (a reverted
#: step's copy-in may or may not have overwritten it).
NEVER_WRITTEN = -1
UNKNOWN = -2

_MASK = (1 << 64) - 1


def _digest_seed(salt: bytes) -> int:
    h = 0xCBF29CE484222325 ^ len(salt)
    for byte in salt:
        h = ((h ^ byte) * 0x100000001B3) & _MASK
    return h


def _digest_next(h: int, token: int) -> int:
    h = ((h ^ (token & 0xFFFFFFFF)) * 0x100000001B3) & _MASK
    return h ^ (h >> 29)


@dataclass(frozen=True)
class Model:
    """Next token = CRC32 of the request id and the context read back, modulo ``vocab``."""

    vocab: int = 50_000
    eos: int | None = None

    def next_token(self, request_id: int, context: np.ndarray) -> int:
        data = np.concatenate([[request_id], context]).astype(np.int64).tobytes()
        return zlib.crc32(data) % self.vocab


@dataclass
class HarnessResult:
    """What one :meth:`Executor.run` of the harness saw."""

    #: Outputs of requests that finished by length or eos.
    outputs: dict[int, list[int]] = field(default_factory=dict)
    #: Outputs of aborted requests.
    aborted: dict[int, list[int]] = field(default_factory=dict)
    #: States aborted requests were in ("decoding", "suspended while pending"...).
    abort_states: set[str] = field(default_factory=set)
    steps: int = 0
    reverted: int = 0
    #: Suspended requests copied back in from the host tier (in steps that ran).
    resumed: int = 0
    victims: list[tuple[int, int]] = field(default_factory=list)
    max_request_victim_choices: int = 0
    # preemptions that took a request past the bound (each for the queue head)
    preemptions_past_bound: int = 0
    #: Decode inputs given as a row of the step in flight (overlap mode).
    inputs_in_flight: int = 0
    #: Prompt tokens admissions found in the prefix cache (their chunks started after).
    cached_tokens: int = 0
    #: Of those, tokens in superblocks that did not hold the reader's KV before the step and
    #: did once the step's earlier context entries wrote theirs (same-step sharing).
    same_step_cached_tokens: int = 0
    #: Draft tokens verified, and accepted (speculative decoding).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    #: KV tokens read back and checked against the KV-content model.
    kv_reads: int = 0
    #: Steps that failed on the device one step ahead (``fail_every``), and pool slots a
    #: reverted step's copy-ins touched.
    failed: int = 0
    reverted_copy_in_slots: int = 0
    #: Draft KV slots marked not valid when their drafts were rejected.
    rejected_draft_slots: int = 0
    metrics: helix_kv.SchedulerMetrics | None = None


class Executor:
    """A simulated executor over a :class:`helix_kv.SimulatedCPGroup`."""

    def __init__(
        self,
        config: helix_kv.SchedulerConfig,
        model: Model = Model(),
        overlap: bool = False,
        drafts: int = 0,
        seed: int = 0,
        reverted_copy_ins: str = "either",
    ) -> None:
        assert reverted_copy_ins in ("either", "done", "not_done")
        self.reverted_copy_ins = reverted_copy_ins
        self.group = helix_kv.SimulatedCPGroup(config)
        self.overlap = overlap
        assert drafts <= int(config.num_speculative_tokens)
        self.drafts = drafts
        self.rng = np.random.default_rng(seed)
        #: Accepted draft counts of each launched step (by step number), for its update.
        self.accepted: dict[int, np.ndarray] = {}
        #: The steps scheduled and not updated yet, each launched with its sampled tokens.
        self.driver: helix_kv.StepDriver[np.ndarray] = helix_kv.StepDriver(
            self.group, one_step_ahead=overlap
        )
        self.config = config
        self.caching = bool(config.enable_prefix_caching)
        self.model = model
        self.cp = int(config.cp_size)
        self.tpb = int(config.tokens_per_block)
        slots = int(config.kv_superblocks) * self.tpb
        # Per rank and slot (the KV-content model): token, owning request (NEVER_WRITTEN,
        # UNKNOWN), position, the digest of the salt and tokens its KV was computed over, and
        # whether it is valid (not a rejected draft's).
        self.token = np.full((self.cp, slots), -1, dtype=np.int64)
        self.owner = np.full((self.cp, slots), NEVER_WRITTEN, dtype=np.int64)
        self.position = np.full((self.cp, slots), -1, dtype=np.int64)
        self.prefix = np.zeros((self.cp, slots), dtype=np.uint64)
        self.valid = np.zeros((self.cp, slots), dtype=bool)
        host_slots = int(config.host_tier_superblocks) * self.tpb
        # Each rank's host KV pool, written and read only through the schedules' host page ids.
        self.host_token = np.full((self.cp, host_slots), -1, dtype=np.int64)
        self.host_owner = np.full((self.cp, host_slots), NEVER_WRITTEN, dtype=np.int64)
        self.host_position = np.full((self.cp, host_slots), -1, dtype=np.int64)
        self.host_prefix = np.zeros((self.cp, host_slots), dtype=np.uint64)
        self.host_valid = np.zeros((self.cp, host_slots), dtype=bool)
        #: Each request's cache salt, and the prefix digests of the tokens seen so far.
        self.salts: dict[int, bytes] = {}
        self._digests: dict[int, tuple[list[int], list[int]]] = {}
        #: Steps that failed on the device (never sampled), and the slots each launched step
        #: wrote drafts' KV into: (request, position, rank, slot) arrays.
        self._failed: set[int] = set()
        self._draft_slots: dict[int, tuple[np.ndarray, ...]] = {}
        #: Host pages each suspended (or just resumed) request holds, in table order.
        self.host: dict[int, list[int]] = {}
        #: Which request holds each host page: a copy-out onto a held page is a race.
        self.host_holder: dict[int, int] = {}
        #: Queue order: ``(0, arrival)``, or under priority admission ``(-priority, arrival)``.
        self.arrival: dict[int, tuple[int, int]] = {}
        self.known: dict[int, list[int]] = {}
        self.prefilled: dict[int, int] = {}
        self.specs: Sequence[Spec] = ()
        #: Requests whose abort waits for the pending step to close.
        self.aborting: set[int] = set()
        self.result = HarnessResult()

    # -- calls --------------------------------------------------------------------------

    def view(self, request_id: int) -> list[int]:
        """What the device knows of a request's tokens: the known ones plus its token of the
        step in flight (one that ran and awaits its update), if any."""
        tokens = list(self.known[request_id])
        for step in self.driver.steps:
            if step.launched and int(step.output.step) not in self._failed:
                rows = np.flatnonzero(step.output.sample_ids == request_id)
                if rows.size:
                    tokens.extend(self._kept(step, request_id, rows).tolist())
        return tokens

    def _kept(
        self, step: helix_kv.PendingStep[np.ndarray], request_id: int, rows: np.ndarray
    ) -> np.ndarray:
        """The tokens a launched step gives a request: its first row, plus its accepted
        drafts' rows for a generation entry (cut after an end-of-sequence)."""
        out = step.output
        entry = np.flatnonzero(out.generation_ids == request_id)
        keep = 1
        if entry.size:
            keep += int(self.accepted[int(out.step)][entry[0]])
        kept = step.sampled[rows[:keep]].astype(np.int64)
        if self.model.eos is not None:
            ends = np.flatnonzero(kept == self.model.eos)
            if ends.size:
                kept = kept[: ends[0] + 1]
        return kept

    def _propose(self) -> None:
        """Proposes up to ``drafts`` drafts to every decoding request: the model's true
        continuation for a random number of tokens, then random tokens."""
        if not self.drafts:
            return
        scheduler = self.group.schedulers[0]
        ids, counts, tokens = [], [], []
        for request_id in scheduler.queue_ids().tolist():
            if scheduler.request_state(request_id) != "decoding":
                continue
            count = int(self.rng.integers(0, self.drafts + 1))
            good = int(self.rng.integers(0, count + 1))
            context = [int(t) for t in self.view(request_id)]
            draft = []
            for j in range(count):
                if j < good:
                    token = self.model.next_token(request_id, np.asarray(context, np.int64))
                else:
                    token = int(self.rng.integers(0, self.model.vocab))
                draft.append(token)
                context.append(token)
            ids.append(request_id)
            counts.append(count)
            tokens.extend(draft)
        if ids:
            self.driver.propose_drafts(ids, counts, np.asarray(tokens, np.int32))

    def add(self, spec: Spec) -> None:
        self.group.add_request(
            spec.request_id,
            spec.prompt(),
            spec.max_new_tokens,
            spec.priority,
            cache_salt=spec.cache_salt,
        )
        self.salts[spec.request_id] = (spec.cache_salt or "").encode()
        rank = -spec.priority if self.config.admission_policy == "priority" else 0
        self.arrival[spec.request_id] = (rank, len(self.arrival))
        queue = self.group.schedulers[0].queue_ids().tolist()
        assert queue == sorted(queue, key=self.arrival.__getitem__), ("queue order", queue)
        self.known[spec.request_id] = spec.prompt().tolist()
        self.prefilled[spec.request_id] = 0

    def state_label(self, request_id: int) -> str | None:
        """The state of a live request not yet being aborted ("recompute-paused" for a
        waiting request that was preempted), else ``None``."""
        scheduler = self.group.schedulers[0]
        if request_id not in self.known or request_id in self.aborting:
            return None
        state = scheduler.request_state(request_id)
        if state == "waiting" and scheduler.request_metrics(request_id).victim_choices > 0:
            return "recompute-paused"
        return state

    def abort(self, request_ids: list[int]) -> None:
        """Aborts on every rank (the group checks they agree); between steps the outputs
        are taken at once, while a step is pending when it closes."""
        if not request_ids:
            return
        pending = self.group.schedulers[0].step_pending
        labels = [self.state_label(r) for r in request_ids]
        self.group.abort_many(request_ids)
        for request_id, label in zip(request_ids, labels):
            if label is None:
                continue  # finished, or already being aborted: a no-op
            self.result.abort_states.add(label + (" while pending" if pending else ""))
            if pending:
                assert self.group.schedulers[0].is_abort_requested(request_id)
                self.aborting.add(request_id)
            else:
                self._collect(request_id)
        if not pending:
            self._check_host_tier()

    def _due_aborts(self, step: int, pending: bool) -> list[int]:
        return [
            spec.request_id
            for spec in self.specs
            if spec.abort_step is not None
            and spec.abort_step <= step
            and spec.abort_pending == pending
            and self.state_label(spec.request_id) is not None
            and (spec.abort_state is None or self.state_label(spec.request_id) == spec.abort_state)
        ]

    def _collect(self, request_id: int) -> None:
        """Takes a finished or aborted request's output and checks it."""
        output = self.group.take_output(request_id)
        assert output.request_id == request_id
        generated = output.token_ids.tolist()
        assert output.metrics.generated_tokens == len(generated)
        known = self.known.pop(request_id)
        assert known[len(known) - len(generated) :] == generated
        self.prefilled.pop(request_id, None)
        self._digests.pop(request_id, None)
        # Retired while a pending step resumes it, it keeps its host copy until that step
        # closes (the step's copy-in reads it).
        if not any(request_id in s.output.resumed_ids.tolist() for s in self.driver.steps):
            self._release_host(request_id)
        if output.finish_reason == "aborted":
            self.result.aborted[request_id] = generated
            self.aborting.discard(request_id)
        else:
            assert request_id not in self.aborting, f"{request_id} was aborted"
            at_eos = self.model.eos is not None and generated[-1:] == [self.model.eos]
            assert output.finish_reason == ("eos" if at_eos else "length")
            self.result.outputs[request_id] = generated

    def _release_host(self, request_id: int) -> None:
        for page in self.host.pop(request_id, []):
            assert self.host_holder.pop(page) == request_id

    def _check_host_tier(self) -> None:
        for scheduler in self.group.schedulers:
            assert scheduler.host_used_superblocks == len(self.host_holder), "host tier leaked"

    def _forget_released_host_copies(self) -> None:
        """After a revert: a host copy the scheduler gave back without a resume (a request
        retired while the reverted step resumed it, or one that re-prefills now)."""
        scheduler = self.group.schedulers[0]
        for request_id in list(self.host):
            if any(request_id in s.output.resumed_ids.tolist() for s in self.driver.steps):
                continue  # a pending step's copy-in reads it until that step closes
            if request_id not in self.known:
                self._release_host(request_id)
            elif scheduler.request_state(request_id) == "waiting":
                self._release_host(request_id)
                self.prefilled[request_id] = 0

    def step(self, revert: bool = False, index: int = 0, fail: bool = False) -> None:
        """Schedules one step and runs it, reverts it (``revert``), or, one step ahead, lets
        it fail on the device (``fail``); after a failed step the next one is reverted, then
        the failed one."""
        before = [
            (s.state_digest(), s.metrics().kv_used_superblocks) for s in self.group.schedulers
        ]
        self._propose()
        out = self.driver.schedule()
        self.abort(self._due_aborts(index, pending=True))
        self._check_victims(out)
        self._copy_out_suspended(out)
        for victim in out.preempted_ids.tolist():
            self.prefilled[victim] = 0
        older = self.driver.steps[0] if self.driver.pending > 1 else None
        if older is not None and int(older.output.step) in self._failed:
            self._copy_in_resumed(out, self.reverted_copy_ins)
            self._revert(out, before)
            self._revert(older.output, None)
            return
        if revert:
            self._copy_in_resumed(out, self.reverted_copy_ins)
            self._revert(out, before)
            return
        if fail and self.overlap:
            # launched, but its attention never runs: copies made, KV not written
            self._copy_in_resumed(out, self.reverted_copy_ins)
            self._failed.add(int(out.step))
            self.accepted[int(out.step)] = np.zeros(out.generation_ids.size, np.int64)
            self.driver.launched(np.zeros(out.num_samples, np.int32))
            self.result.failed += 1
            due = self.driver.due()  # the step before it, which ran
            if due is not None and due.output is not out:
                self._commit(due)
            return
        inputs = self._check_replay(out)
        self._copy_in_resumed(out)
        self.result.resumed += out.resumed_ids.size
        self._count_same_step_hits(out)
        self._write_kv(out, inputs)
        self._check_chunks(out)
        tokens, accepted = self._sample(out)
        self.accepted[int(out.step)] = accepted
        ends = (out.context_starts + out.context_lens).tolist()
        for request_id, end, completes in zip(
            out.context_ids.tolist(), ends, out.context_completes.tolist()
        ):
            self.prefilled[request_id] = 0 if completes else end
        self.driver.launched(tokens)
        due = self.driver.due()  # plain: this step; one step ahead: the one before it
        if due is not None:
            self._commit(due)

    def _revert(self, out: helix_kv.ScheduleOutput, before: list[tuple[int, int]] | None) -> None:
        """Reverts the newest pending step (``out``); ``before``: the ranks' state before it
        was scheduled, when nothing closed since (not for a failed step one step ahead)."""
        aborted = self.driver.revert().tolist()
        # with an older step still pending, requested aborts wait for its close
        still_pending = self.group.pending_steps() > 0
        assert still_pending == (self.driver.pending > 0)
        queue_order = [] if still_pending else sorted(self.aborting, key=self.arrival.__getitem__)
        assert aborted == queue_order, "revert aborts the requested ones, in queue order"
        for request_id in aborted:
            self._collect(request_id)
        self._forget_released_host_copies()
        self._check_host_tier()
        self._failed.discard(int(out.step))
        self.accepted.pop(int(out.step), None)
        # A prefix the step evicted from a page it resumed a request onto is not put back
        # (the copy-in may have overwritten it): the one inexact undo besides victims.
        exact = (
            before is not None
            and not self.aborting
            and not aborted
            and out.preempted_ids.size == 0
            and out.suspended_ids.size == 0
            and not (self.caching and out.resumed_ids.size)
        )
        if exact:
            after = [
                (s.state_digest(), s.metrics().kv_used_superblocks) for s in self.group.schedulers
            ]
            assert after == before, "revert must restore the scheduler and ledger"
        self.result.reverted += 1

    def _commit(self, step: helix_kv.PendingStep[np.ndarray]) -> None:
        """Updates the group with a step's sampled tokens (the oldest pending step)."""
        out, tokens = step.output, step.sampled
        assert int(out.step) not in self._failed, "a failed step is reverted, never updated"
        self._reject_drafts(out)
        eos = None if self.model.eos is None else tokens == self.model.eos
        kept = {}
        for request_id in dict.fromkeys(out.sample_ids.tolist()):
            rows = np.flatnonzero(out.sample_ids == request_id)
            kept[request_id] = self._kept(step, request_id, rows).tolist()
        accepted = self.accepted.pop(int(out.step))
        finished = self.driver.complete(tokens, eos, accepted if self.drafts else None)
        assert finished.dtype == np.uint64  # the ids dtype of every contract implementation
        for request_id, taken in kept.items():
            # an aborted request's tokens are dropped; one finished meanwhile is gone
            if request_id not in self.aborting and request_id in self.known:
                room = self.known_room(request_id)
                self.known[request_id].extend(taken[:room])
        for request_id in out.resumed_ids.tolist():
            self._release_host(request_id)  # the update frees the host pages a resume read
        for request_id in finished.tolist():
            self._collect(request_id)
        assert not self.aborting, "every requested abort took effect at update"
        self._check_host_tier()
        self.result.steps += 1
        for request_id in self.group.schedulers[0].queue_ids().tolist():
            chosen = self.group.schedulers[0].request_metrics(request_id).victim_choices
            self.result.max_request_victim_choices = max(
                self.result.max_request_victim_choices, chosen
            )

    def run(
        self,
        specs: Sequence[Spec],
        revert_every: int = 0,
        max_steps: int = 5_000,
        fail_every: int = 0,
    ) -> HarnessResult:
        pending = sorted(specs, key=lambda s: s.arrival_step)
        self.specs = pending
        next_spec, step, scheduled = 0, 0, 0
        while True:
            while next_spec < len(pending) and pending[next_spec].arrival_step <= step:
                self.add(pending[next_spec])
                next_spec += 1
            self.abort(self._due_aborts(step, pending=False))
            if next_spec == len(pending) and not self.group.has_unfinished():
                newest = self.driver.newest
                if newest is not None and int(newest.output.step) in self._failed:
                    self._revert(newest.output, None)
                    continue
                for pending_step in self.driver.drain():
                    self._commit(pending_step)
                break
            assert step < max_steps, f"no completion in {max_steps} steps"
            scheduled += 1
            if revert_every and scheduled % revert_every == 0:
                self.step(revert=True, index=step)
                continue
            if fail_every and scheduled % fail_every == 0:
                self.step(index=step, fail=True)
                continue
            self.step(index=step)
            step += 1
        for scheduler in self.group.schedulers:
            metrics = scheduler.metrics()
            assert metrics.kv_used_superblocks == 0, "superblocks leaked"
            assert scheduler.host_used_superblocks == 0, "host tier leaked"
            assert scheduler.num_live == 0
            assert scheduler.pending_steps() == 0
            assert self.driver.pending == 0
            assert metrics.aborts == len(self.result.aborted)
            assert metrics.finished == len(self.result.outputs)
        self.result.metrics = self.group.metrics()
        return self.result

    # -- checks and the simulated executor ----------------------------------------------

    def _check_victims(self, out: helix_kv.ScheduleOutput) -> None:
        pairs = list(zip(out.preempted_ids.tolist(), out.preempted_requester_ids.tolist()))
        pairs += list(zip(out.suspended_ids.tolist(), out.suspended_requester_ids.tolist()))
        # a suspended queue head that preempted to come back is served by its resume
        served = set(out.generation_ids.tolist()) | set(out.context_ids.tolist())
        served |= set(out.resumed_ids.tolist())
        head = min(self.known, key=self.arrival.__getitem__, default=None)
        bound = int(self.config.max_preemptions_per_request)
        scheduler = self.group.schedulers[0]
        for victim, requester in pairs:
            assert self.arrival[victim] > self.arrival[requester], (victim, requester)
            assert victim not in out.generation_ids.tolist()
            assert requester in served, f"futile preemption of {victim} for {requester}"
            if scheduler.request_metrics(victim).victim_choices > bound:
                assert requester == head, (victim, requester, head)
                self.result.preemptions_past_bound += 1
        self.result.victims.extend(pairs)

    def _check_replay(self, out: helix_kv.ScheduleOutput) -> np.ndarray:
        """Checks chunks and decode inputs against the tokens; returns the decode inputs, those
        still in flight resolved by the driver from the step in flight's sampled tokens."""
        offset = 0
        for request_id, start, length, completes, cached in zip(
            out.context_ids.tolist(),
            out.context_starts.tolist(),
            out.context_lens.tolist(),
            out.context_completes.tolist(),
            out.context_cached_lens.tolist(),
        ):
            chunk = out.context_token_ids[offset : offset + length].tolist()
            offset += length
            known = self.view(request_id)
            if cached:
                # An admission that found its first superblocks cached: their KV is read
                # back from slots another request (with the same prefix) wrote.
                assert self.caching
                assert self.prefilled[request_id] == 0
                assert start == cached, "the chunk starts after the cached tokens"
                assert start % (self.tpb * self.cp) == 0, "a hit ends inside a superblock"
                assert start < len(known), "the last prompt token is always computed"
                self.result.cached_tokens += cached
            else:
                assert start == self.prefilled[request_id], "a chunk continues its prefill"
            assert chunk == known[start : start + length], "re-prefill tokens are the context"
            assert completes == (start + length == len(known))
        step = self.driver.newest
        assert step is not None
        assert step.output is out
        flight = step.inputs_in_flight
        if len(flight):
            older = step.previous
            assert older is not None, "inputs in flight need a step in flight"
            assert older.launched
            given = out.generation_input_tokens[flight.entries]
            assert np.all(given == -1), "an input in flight is given as a row only"
            named = older.output.sample_ids[flight.rows]
            assert np.array_equal(named, out.generation_ids[flight.entries]), "another's row"
            self.result.inputs_in_flight += len(flight)
        inputs = self.driver.decode_inputs()
        for request_id, position, token in zip(
            out.generation_ids.tolist(), out.generation_positions.tolist(), inputs.tolist()
        ):
            known = self.view(request_id)
            assert position == len(known) - 1, "decode continues from the prompt end"
            assert token == known[-1]
        return inputs

    def _pages(self, table: np.ndarray) -> np.ndarray:
        return (table[:, None] * self.tpb + np.arange(self.tpb)).ravel()

    def _copy_out_suspended(self, out: helix_kv.ScheduleOutput) -> None:
        """Each rank copies its share of every suspended page to the page's host page."""
        assert out.suspended_host_block_ids.size == out.suspended_block_ids.size
        offset = 0
        for request_id, count in zip(
            out.suspended_ids.tolist(), out.suspended_block_counts.tolist()
        ):
            pages = out.suspended_block_ids[offset : offset + count].astype(np.int64)
            host_pages = out.suspended_host_block_ids[offset : offset + count].astype(np.int64)
            offset += count
            for page in host_pages.tolist():
                holder = self.host_holder.setdefault(page, request_id)
                assert holder == request_id, f"host page {page} of {holder} overwritten"
            assert request_id not in self.host
            self.host[request_id] = host_pages.tolist()
            src, dst = self._pages(pages), self._pages(host_pages)
            self.host_token[:, dst] = self.token[:, src]
            self.host_owner[:, dst] = self.owner[:, src]
            self.host_position[:, dst] = self.position[:, src]
            self.host_prefix[:, dst] = self.prefix[:, src]
            self.host_valid[:, dst] = self.valid[:, src]

    def _copy_in_resumed(self, out: helix_kv.ScheduleOutput, reverted: str | None = None) -> None:
        """Each rank copies its share of every resumed page back from its host page, in a step
        that runs (``reverted`` None), or as a reverted step's copy-ins did: ``"done"``,
        ``"not_done"``, or ``"either"`` (the slots become unknown: nothing may read them)."""
        assert out.resumed_host_block_ids.size == out.resumed_block_ids.size
        offset = 0
        for request_id, count in zip(out.resumed_ids.tolist(), out.resumed_block_counts.tolist()):
            pages = out.resumed_block_ids[offset : offset + count].astype(np.int64)
            host_pages = out.resumed_host_block_ids[offset : offset + count].astype(np.int64)
            offset += count
            assert self.host[request_id] == host_pages.tolist(), "resumes from its host pages"
            if reverted is None:
                table = self.group.schedulers[0].block_table([request_id])[0]
                assert table[:count].tolist() == pages.tolist(), "resumes into its first pages"
            src, dst = self._pages(host_pages), self._pages(pages)
            if reverted is not None:
                self.result.reverted_copy_in_slots += dst.size * self.cp
            if reverted == "not_done":
                continue
            if reverted == "either":
                self.owner[:, dst] = UNKNOWN
                self.valid[:, dst] = False
                continue
            self.token[:, dst] = self.host_token[:, src]
            self.owner[:, dst] = self.host_owner[:, src]
            self.position[:, dst] = self.host_position[:, src]
            self.prefix[:, dst] = self.host_prefix[:, src]
            self.valid[:, dst] = self.host_valid[:, src]

    def _prefix_digests(self, request_id: int, seq: Sequence[int]) -> np.ndarray:
        """The digest of each prefix of ``seq`` (the request's tokens as a step sees them)
        under the request's salt: entry ``i`` covers ``seq[: i + 1]``, what the KV of position
        ``i`` depends on. Kept per request and extended as its tokens grow."""
        tokens, digests = self._digests.get(request_id, ([], []))
        common = min(len(tokens), len(seq))
        if tokens[:common] != list(seq[:common]):  # drafts since rejected: recompute past them
            common = next(i for i, (a, b) in enumerate(zip(tokens, seq)) if a != b)
        tokens, digests = tokens[:common], digests[:common]
        h = digests[-1] if digests else _digest_seed(self.salts[request_id])
        for token in seq[common:]:
            h = _digest_next(h, int(token))
            tokens.append(int(token))
            digests.append(h)
        self._digests[request_id] = (tokens, digests)
        return np.asarray(digests[: len(seq)], dtype=np.uint64)

    def _write_kv(self, out: helix_kv.ScheduleOutput, inputs: np.ndarray) -> None:
        ids = np.concatenate([out.context_ids, out.generation_ids])
        starts = np.concatenate([out.context_starts, out.generation_positions])
        drafts = out.generation_draft_counts
        counts = np.concatenate([out.context_lens, 1 + drafts])
        # Each generation entry's query tokens: its input, then its drafts.
        first = np.cumsum(1 + drafts) - (1 + drafts)
        queries = np.zeros(int((1 + drafts).sum()), np.int64)
        is_first = np.zeros(queries.size, bool)
        is_first[first] = True
        queries[is_first] = inputs
        queries[~is_first] = out.generation_draft_tokens
        values = np.concatenate([out.context_token_ids, queries])
        total = int(counts.sum())
        first = np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(starts, counts) + np.arange(total) - first
        who = np.repeat(ids, counts)
        is_draft = np.concatenate([np.zeros(out.context_token_ids.size, bool), ~is_first])
        prefix = np.concatenate(
            [
                self._prefix_digests(int(request_id), seq)[start : start + count]
                for request_id, seq, start, count in zip(
                    ids.tolist(), self._entry_seqs(out), starts.tolist(), counts.tolist()
                )
            ]
            or [np.zeros(0, np.uint64)]
        )
        owners = (positions // self.tpb) % self.cp
        slots = []
        for rank, scheduler in enumerate(self.group.schedulers):
            mapped = scheduler.slot_mapping(ids, starts, counts)
            assert mapped.dtype == np.int64
            assert mapped.shape == (total,)
            assert np.array_equal(mapped >= 0, owners == rank), "a rank writes exactly what it owns"
            slots.append(mapped)
        # Entry by entry, context entries first: each hit is read back just before its own
        # entry's writes, after those of the step's earlier context entries.
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        cut = 0
        for entry, (request_id, cached) in enumerate(
            zip(out.context_ids.tolist(), out.context_cached_lens.tolist())
        ):
            if cached:
                written = slice(cut, int(offsets[entry]))
                self._write_tokens(slots, written, values, who, positions, prefix)
                cut = int(offsets[entry])
                self._read_context(request_id, cached - 1)
        self._write_tokens(slots, slice(cut, total), values, who, positions, prefix)
        drafted = []
        for rank in range(self.cp):
            take = (slots[rank] >= 0) & is_draft
            drafted.append(
                (who[take], positions[take], np.full(take.sum(), rank), slots[rank][take])
            )
        self._draft_slots[int(out.step)] = tuple(
            np.concatenate([d[k] for d in drafted]) for k in range(4)
        )

    def _write_tokens(
        self,
        slots: list[np.ndarray],
        tokens: slice,
        values: np.ndarray,
        who: np.ndarray,
        positions: np.ndarray,
        prefix: np.ndarray,
    ) -> None:
        """Each rank writes the KV of the step's ``tokens`` (a range of its token rows) that it
        owns, through its slot mapping (``slots``, per rank)."""
        for rank, mapped in enumerate(slots):
            mine = np.flatnonzero(mapped[tokens] >= 0) + (tokens.start or 0)
            at = mapped[mine]
            self.token[rank, at] = values[mine]
            self.owner[rank, at] = who[mine]
            self.position[rank, at] = positions[mine]
            self.prefix[rank, at] = prefix[mine]
            self.valid[rank, at] = True

    def _entry_seqs(self, out: helix_kv.ScheduleOutput) -> list[list[int]]:
        """Each entry's tokens as the step sees them (context entries, then generation
        entries with their drafts): what its KV depends on."""
        seqs = [self.view(request_id) for request_id in out.context_ids.tolist()]
        offset = 0
        for request_id, count in zip(
            out.generation_ids.tolist(), out.generation_draft_counts.tolist()
        ):
            drafts = out.generation_draft_tokens[offset : offset + count].tolist()
            offset += count
            seqs.append(self.view(request_id) + drafts)
        return seqs

    def _count_same_step_hits(self, out: helix_kv.ScheduleOutput) -> None:
        """Before the step writes anything: the superblocks of each admission's hit that do
        not hold the KV it needs yet (an earlier context entry of the step writes them; the
        hit is checked in :meth:`_write_kv`)."""
        per = self.tpb * self.cp
        for request_id, cached in zip(out.context_ids.tolist(), out.context_cached_lens.tolist()):
            if cached:
                wrong = self._context_errors(request_id, cached - 1)
                missing = np.unique(np.flatnonzero(wrong) // per)
                self.result.same_step_cached_tokens += int(missing.size) * per

    def _check_chunks(self, out: helix_kv.ScheduleOutput) -> None:
        """Each chunk's tokens read the context before them (a completing chunk's last token
        reads it all again when it is sampled)."""
        ends = out.context_starts + out.context_lens
        for request_id, end, completes in zip(
            out.context_ids.tolist(), ends.tolist(), out.context_completes.tolist()
        ):
            if not completes:
                self._read_context(request_id, end - 1)

    def _reject_drafts(self, out: helix_kv.ScheduleOutput) -> None:
        """A completing step's rejected drafts (past each entry's accepted ones): their KV
        was written and is not the request's; the slots still hold that write."""
        who, positions, ranks, slots = self._draft_slots.pop(
            int(out.step), (np.zeros(0, np.int64),) * 4
        )
        if not who.size:
            return
        accepted = self.accepted[int(out.step)]
        kept_to = dict(
            zip(out.generation_ids.tolist(), (out.generation_positions + accepted).tolist())
        )
        rejected = positions > np.asarray([kept_to[int(r)] for r in who.tolist()], np.int64)
        ranks, slots = ranks[rejected], slots[rejected]
        assert np.array_equal(self.owner[ranks, slots], who[rejected]), "a draft overwritten"
        assert np.array_equal(self.position[ranks, slots], positions[rejected])
        self.valid[ranks, slots] = False
        self.result.rejected_draft_slots += int(rejected.sum())

    def known_room(self, request_id: int) -> int:
        """How many more tokens the request may take (its ``max_new_tokens`` left)."""
        spec = next(s for s in self.specs if s.request_id == request_id)
        prompt = spec.shared_prefix + spec.prompt_len
        return prompt + spec.max_new_tokens - len(self.known[request_id])

    def _read_context(self, request_id: int, last: int, drafts: Sequence[int] = ()) -> np.ndarray:
        """Reads positions ``0..=last`` of the request back through its block table, as
        attention would, and checks each slot against the KV-content model: the KV of the
        request's token there (``drafts`` after what the device knows of it), valid, computed
        over the same salt and tokens before it, and without prefix caching its own."""
        wrong, owners, slots, seq = self._context_cells(request_id, last, drafts)
        if wrong.any():
            at = int(np.flatnonzero(wrong)[0])
            raise AssertionError(
                f"KV of {request_id} at {at} (token {seq[at]}) is not there: rank "
                f"{owners[at]} slot {slots[at]} holds owner {self.owner[owners[at], slots[at]]}, "
                f"position {self.position[owners[at], slots[at]]}, token "
                f"{self.token[owners[at], slots[at]]}, valid {self.valid[owners[at], slots[at]]}"
            )
        self.result.kv_reads += last + 1
        return self.token[owners, slots]

    def _context_errors(self, request_id: int, last: int) -> np.ndarray:
        """Per position ``0..=last`` of the request, whether :meth:`_read_context` would reject
        its slot now."""
        return self._context_cells(request_id, last)[0]

    def _context_cells(
        self, request_id: int, last: int, drafts: Sequence[int] = ()
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """The slots of positions ``0..=last`` of the request through its block table (each
        position's owner rank and slot), which of them do not hold the KV the request needs
        there, and the tokens it needs."""
        tables = [s.block_table([request_id])[0] for s in self.group.schedulers]
        for table in tables[1:]:
            assert np.array_equal(table, tables[0]), "every rank holds the same table"
        positions = np.arange(last + 1)
        owners = (positions // self.tpb) % self.cp
        pages = tables[0][positions // (self.tpb * self.cp)].astype(np.int64)
        slots = pages * self.tpb + positions % self.tpb
        seq = [*self.view(request_id), *drafts][: last + 1]
        expected = self._prefix_digests(request_id, seq)
        owner = self.owner[owners, slots]
        wrong = (
            (owner < 0)
            | ~self.valid[owners, slots]
            | (self.position[owners, slots] != positions)
            | (self.token[owners, slots] != np.asarray(seq, dtype=np.int64))
            | (self.prefix[owners, slots] != expected)
        )
        if not self.caching:
            wrong |= owner != request_id
        return wrong, owners, slots, seq

    def _sample(self, out: helix_kv.ScheduleOutput) -> tuple[np.ndarray, np.ndarray]:
        """The model's token at every sample row (each query row of a drafted entry, read
        back with the drafts before it), and each generation entry's accepted drafts."""
        last = dict(zip(out.generation_ids.tolist(), out.generation_positions.tolist()))
        drafted: dict[int, list[int]] = {}
        offset = 0
        for request_id, count in zip(
            out.generation_ids.tolist(), out.generation_draft_counts.tolist()
        ):
            drafted[request_id] = out.generation_draft_tokens[offset : offset + count].tolist()
            offset += count
        ends = out.context_starts + out.context_lens - 1
        for request_id, end, completes in zip(
            out.context_ids.tolist(), ends.tolist(), out.context_completes.tolist()
        ):
            if completes:
                last[request_id] = end
        tokens = []
        row_of: dict[int, int] = {}
        for request_id in out.sample_ids.tolist():
            j = row_of.get(request_id, 0)
            row_of[request_id] = j + 1
            end = last[request_id] + j
            context = self._read_context(request_id, end, drafted.get(request_id, [])[:j])
            expected = self.view(request_id)[: last[request_id] + 1]
            expected += drafted.get(request_id, [])[:j]
            assert context.tolist() == expected
            tokens.append(self.model.next_token(request_id, context))
        sampled = np.asarray(tokens, dtype=np.int32)
        accepted = np.zeros(out.generation_ids.size, np.int64)
        row = 0
        for i, request_id in enumerate(out.generation_ids.tolist()):
            draft = drafted[request_id]
            while accepted[i] < len(draft) and draft[accepted[i]] == sampled[row + accepted[i]]:
                accepted[i] += 1
            row += 1 + len(draft)
            self.result.draft_tokens += len(draft)
            self.result.accepted_tokens += int(accepted[i])
        return sampled, accepted


def reference_outputs(specs: Sequence[Spec], model: Model = Model()) -> dict[int, list[int]]:
    """The same requests with no pressure: one rank, a pool that holds everything."""
    total = sum(s.shared_prefix + s.prompt_len + s.max_new_tokens for s in specs)
    config = helix_kv.SchedulerConfig(
        tokens_per_block=4,
        kv_superblocks=total // 4 + len(specs) + 1,
        max_batch_size=len(specs) + 1,
        max_num_tokens=max(total + 1, 4),
    )
    at_once = [
        Spec(
            s.request_id,
            s.prompt_len,
            s.max_new_tokens,
            s.priority,
            shared_prefix=s.shared_prefix,
            twin_of=s.twin_of,
        )
        for s in specs
    ]
    result = Executor(config, model).run(at_once)
    assert result.metrics is not None
    assert result.metrics.preemptions == 0
    return result.outputs


def assert_matches_reference(specs: Sequence[Spec], result: HarnessResult, model: Model = Model()):
    reference = reference_outputs(specs, model)
    assert set(result.outputs) == {s.request_id for s in specs}
    for spec in specs:
        got = result.outputs[spec.request_id]
        assert got == reference[spec.request_id], f"request {spec.request_id} output differs"
        at_eos = model.eos is not None and got and got[-1] == model.eos
        assert len(got) == spec.max_new_tokens or (at_eos and len(got) < spec.max_new_tokens)


def assert_matches_reference_with_aborts(
    specs: Sequence[Spec], result: HarnessResult, model: Model = Model()
) -> None:
    """Every request finished exactly as in the reference, or was aborted (as asked) with a
    strict prefix of its reference output."""
    assert len(result.outputs) + len(result.aborted) == len(specs)
    survivors = [s for s in specs if s.request_id not in result.aborted]
    finished = HarnessResult(outputs=result.outputs)
    assert_matches_reference(survivors, finished, model)
    reference = reference_outputs(specs, model)
    by_id = {s.request_id: s for s in specs}
    for request_id, got in result.aborted.items():
        full = reference[request_id]
        assert len(got) < len(full), (request_id, got, full)
        assert full[: len(got)] == got, (request_id, got, full)
        assert by_id[request_id].abort_step is not None, f"{request_id} was aborted unasked"
