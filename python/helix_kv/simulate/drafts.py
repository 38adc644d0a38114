"""The simulator's drafter and verifier for speculative decoding (``--spec-tokens K
--acceptance P``).

No model runs here, so a draft's acceptance is a seeded coin: the draft token a request
proposes for its output token ``i`` is the token it will sample there (:mod:`.tokens`) with
probability ``P``, and a wrong one otherwise. The coin is a pure function of the seed, the
request id and ``i`` (a counter-based mix, as the shared prompt content is), so every rank and
every process proposes exactly the same drafts, and the same request draws the same coins
whatever the schedule (plain or one step ahead, any ``--cp``, under pressure or not).

Verification is then what an engine's greedy verification does: of the ``k`` drafts a step
scheduled for a request, the leading ones equal to the tokens it samples are accepted, and the
``1 + k`` rows the step samples are the request's next ``1 + k`` tokens, of which the
scheduler keeps ``accepted + 1``. So a step's accepted count is the number of leading successes
of ``k`` Bernoulli(``P``) trials: a coin is looked at only after every coin before it in the
step came up, and a step starts right after the token the previous one stopped at (a
rejection's position is sampled anew, with no draft), so every step draws coins no earlier
step has looked at. Outputs stay exactly those without drafts, which the run checks.

Drafts are proposed for every request that has sampled a token and has at least two tokens
left, ``min(K, left - 1)`` each (the scheduler never schedules a draft past
``max_new_tokens``, so a proposal past it would only read as trimmed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from helix_kv.simulate.tokens import VOCAB_SIZE, _mix, sampled_tokens

__all__ = ["DEFAULT_ACCEPTANCE", "DraftModel", "DraftProposal"]

#: ``--acceptance`` when not given: a typical per-token acceptance of a good draft model (EAGLE
#: and MTP heads report 0.6 to 0.8 on chat traffic; n-gram drafters less).
DEFAULT_ACCEPTANCE = 0.7

_DOMAIN_ACCEPT = 0x41434345505F5350  # "ACCEP_SP"
_U64 = np.uint64
_UNIT = float(1 << 53)


@dataclass(frozen=True)
class DraftProposal:
    """What :meth:`DraftModel.propose` gives ``propose_drafts``: ``counts[i]`` drafts for
    ``request_ids[i]``, their tokens concatenated (int32)."""

    request_ids: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.request_ids.size)


@dataclass(frozen=True)
class DraftModel:
    """``num_tokens`` drafts per decode (the scheduler's ``num_speculative_tokens``), each
    accepted with probability ``acceptance``, the coins seeded by ``seed``."""

    num_tokens: int
    acceptance: float = DEFAULT_ACCEPTANCE
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.num_tokens <= 64:
            raise ValueError(f"num_tokens must be in [1, 64], got {self.num_tokens}")
        if not 0.0 <= self.acceptance <= 1.0:  # also rejects NaN
            raise ValueError(f"acceptance must be in [0, 1], got {self.acceptance}")
        if not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2^64 - 1], got {self.seed}")

    def coins(self, request_ids: np.ndarray, indices: np.ndarray) -> np.ndarray:
        """Whether the draft of output token ``indices[k]`` of ``request_ids[k]`` is right
        (bool, elementwise)."""
        if self.acceptance >= 1.0:
            return np.ones(np.shape(indices), dtype=bool)
        ids = np.asarray(request_ids, dtype=np.uint64)
        seeds = _mix(_mix(ids ^ _U64(_DOMAIN_ACCEPT)) ^ _U64(self.seed))
        mixed = _mix(seeds + np.asarray(indices, dtype=np.uint64))
        uniform = (mixed >> _U64(11)).astype(np.float64) / _UNIT  # in [0, 1)
        result: np.ndarray = uniform < self.acceptance
        return result

    def propose(self, live: Iterable[tuple[int, int, int]]) -> DraftProposal:
        """Drafts for ``(request_id, generated, output_len)`` of each live request: those that
        sampled a token and have two or more left get ``min(num_tokens, left - 1)`` drafts for
        their next output tokens, each the token it will sample if its coin comes up and
        another one otherwise."""
        ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        for request_id, generated, output_len in live:
            count = min(self.num_tokens, output_len - generated - 1)
            if generated >= 1 and count > 0:
                ids.append(request_id)
                starts.append(generated)
                counts.append(count)
        counts_array = np.asarray(counts, dtype=np.int64)
        ids_array = np.asarray(ids, dtype=np.uint64)
        token_ids = np.repeat(ids_array, counts_array)
        offsets = np.arange(token_ids.size, dtype=np.int64) - np.repeat(
            np.cumsum(counts_array) - counts_array, counts_array
        )
        indices = np.repeat(np.asarray(starts, dtype=np.int64), counts_array) + offsets
        right = sampled_tokens(token_ids, indices.astype(np.uint64))
        wrong = ((right.astype(np.int64) + 1) % VOCAB_SIZE).astype(np.int32)
        tokens = np.where(self.coins(token_ids, indices), right, wrong).astype(np.int32)
        return DraftProposal(ids_array.astype(np.int64), counts_array, tokens)

    def to_dict(self) -> dict[str, float | int]:
        """The report's ``config.drafts``."""
        return {"acceptance": self.acceptance, "seed": self.seed}


def verify(draft_counts: np.ndarray, draft_tokens: np.ndarray, sampled: np.ndarray) -> np.ndarray:
    """Greedy verification: per generation entry with ``draft_counts[i]`` drafts (their tokens
    concatenated in ``draft_tokens``) and its ``1 + draft_counts[i]`` sampled rows (concatenated
    in ``sampled``), how many leading drafts equal the token sampled at their position (int64).
    """
    counts = np.asarray(draft_counts, dtype=np.int64)
    accepted = np.zeros(counts.size, dtype=np.int64)
    draft_at = 0
    row_at = 0
    for entry, count in enumerate(counts.tolist()):
        if count:
            equal = draft_tokens[draft_at : draft_at + count] == sampled[row_at : row_at + count]
            accepted[entry] = count if equal.all() else int(np.argmin(equal))
        draft_at += count
        row_at += count + 1
    return accepted
