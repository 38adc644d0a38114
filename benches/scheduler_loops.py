"""The scheduler loops the host benches time: ``N`` live requests at cp = 4, finished ones
replaced so ``N`` stay live, plain or one step ahead. Shared by ``bench_scheduler.py`` and
``vllm_compare.py``; it imports no pytest, so the side-by-side runs in an environment that has
only vLLM and helix_kv.
"""

from __future__ import annotations

import numpy as np

import helix_kv

CP, TPB, PROMPT = 4, 32, 100


def scheduler(
    n: int, superblocks: int, max_new: int, prefix_caching: bool = False, drafts: int = 0
) -> helix_kv.Scheduler:
    config = helix_kv.SchedulerConfig(
        cp_size=CP,
        tokens_per_block=TPB,
        kv_superblocks=superblocks,
        max_batch_size=max(n, 1),
        max_num_tokens=n + 4096,
        max_preemptions_per_request=1_000_000,
        enable_prefix_caching=prefix_caching,
        num_speculative_tokens=drafts,
    )
    return helix_kv.Scheduler(config)


class Loop:
    """``n`` live requests; finished ones are replaced so ``n`` stay live. With
    ``prefix_caching`` every request's prompt is its own (no hits: the cost of the cache's
    bookkeeping alone); without, they share one prompt, as before."""

    def __init__(
        self, n: int, superblocks: int, max_new: int, prefix_caching: bool = False
    ) -> None:
        self.s = scheduler(n, superblocks, max_new, prefix_caching)
        self.prefix_caching = prefix_caching
        self.prompt = np.arange(PROMPT, dtype=np.int32)
        self.max_new = max_new
        self.tokens = np.full(n + 4096, 7, dtype=np.int32)
        self.next_id = 0
        for _ in range(n):
            self.add()

    def add(self) -> None:
        prompt = self.prompt + PROMPT * self.next_id if self.prefix_caching else self.prompt
        self.s.add_request(self.next_id, prompt, self.max_new)
        self.next_id += 1

    def step(self) -> helix_kv.ScheduleOutput:
        out = self.s.schedule()
        for request_id in self.s.update(self.tokens[: out.num_samples]).tolist():
            self.s.take_output(request_id)
            self.add()
        return out

    def prefill(self) -> None:
        """Steps until every live request is decoding."""
        while self.step().context_ids.size or self.s.num_waiting:
            pass


class AheadLoop(Loop):
    """:class:`Loop` one step ahead: each step schedules while the previous one is pending,
    then updates that one (its tokens in flight until then)."""

    def __init__(self, n: int, superblocks: int, max_new: int) -> None:
        super().__init__(n, superblocks, max_new)
        self.in_flight: helix_kv.ScheduleOutput | None = None

    def step(self) -> helix_kv.ScheduleOutput:
        out = self.s.schedule()
        older, self.in_flight = self.in_flight, out
        if older is not None:
            for request_id in self.s.update(self.tokens[: older.num_samples]).tolist():
                self.s.take_output(request_id)
                self.add()
        return out


class DraftLoop(Loop):
    """:class:`Loop` with speculative decoding: before each step every request that decoded in
    the last one is proposed ``drafts`` draft tokens (one numpy call), and each update accepts
    ``accepted`` of them (the rest are rolled back). The ids come from the last output, so the
    loop makes no Python object per request."""

    def __init__(self, n: int, superblocks: int, max_new: int, drafts: int, accepted: int) -> None:
        self.drafts, self.accepted = drafts, accepted
        self.s = scheduler(n, superblocks, max_new, drafts=drafts)
        self.prefix_caching = False
        self.prompt = np.arange(PROMPT, dtype=np.int32)
        self.max_new = max_new
        rows = (n + 4096) * (1 + drafts)
        self.tokens = np.full(rows, 7, dtype=np.int32)
        self.draft_tokens = np.full(rows, 7, dtype=np.int32)
        self.counts = np.full(n + 4096, drafts, dtype=np.int64)
        self.accepted_counts = np.full(n + 4096, accepted, dtype=np.int64)
        self.decoding = np.zeros(0, dtype=np.uint64)
        self.next_id = 0
        for _ in range(n):
            self.add()

    def step(self) -> helix_kv.ScheduleOutput:
        if not self.drafts:  # drafts off: the plain loop, as an engine without drafts runs
            out = self.s.schedule()
            for request_id in self.s.update(self.tokens[: out.num_samples]).tolist():
                self.s.take_output(request_id)
                self.add()
            return out
        m = self.decoding.size
        if m:
            self.s.propose_drafts(
                self.decoding, self.counts[:m], self.draft_tokens[: m * self.drafts]
            )
        out = self.s.schedule()
        counts = out.generation_draft_counts
        accepted = np.minimum(self.accepted_counts[: counts.size], counts)
        finished = self.s.update(self.tokens[: out.num_samples], None, accepted)
        for request_id in finished.tolist():
            self.s.take_output(request_id)
            self.add()
        self.decoding = out.generation_ids
        return out


class DraftAheadLoop(DraftLoop):
    """:class:`DraftLoop` one step ahead: each step proposes and schedules while the previous
    one is pending, then updates that one (``accepted`` of its drafts accepted). Proposals go
    to the requests that decoded in the step updated last, as an engine that drafts from the
    tokens it knows does (a request whose pending decode carries drafts is not planned ahead,
    so its proposal is ignored)."""

    def __init__(self, n: int, superblocks: int, max_new: int, drafts: int, accepted: int) -> None:
        super().__init__(n, superblocks, max_new, drafts, accepted)
        self.in_flight: helix_kv.ScheduleOutput | None = None

    def step(self) -> helix_kv.ScheduleOutput:
        m = self.decoding.size
        if self.drafts and m:
            self.s.propose_drafts(
                self.decoding, self.counts[:m], self.draft_tokens[: m * self.drafts]
            )
        out = self.s.schedule()
        older, self.in_flight = self.in_flight, out
        if older is not None:
            counts = older.generation_draft_counts
            accepted = np.minimum(self.accepted_counts[: counts.size], counts)
            finished = self.s.update(self.tokens[: older.num_samples], None, accepted)
            for request_id in finished.tolist():
                self.s.take_output(request_id)
                self.add()
            self.decoding = older.generation_ids
        return out
