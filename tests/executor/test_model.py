"""The tiny transformer through the KV pool: chunked, decode and mixed steps agree (float64).

No scheduler is involved: block tables are written by hand (deliberately scattered page ids)
and every step is a :class:`StepPlan` built from plain arrays, on a single rank (cp = 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from helix_kv.executor import KVPool, RankPlacement, StepPlan, TinyConfig, TinyTransformer
from helix_kv.executor.reference import dense_logits

TOL = 1e-11
TPB = 4
CONFIG = TinyConfig(num_layers=3, seed=1234)
PLACEMENT = RankPlacement(cp_size=1, tokens_per_block=TPB, cp_rank=0)
TABLES = {  # request id -> its pages (scattered on purpose)
    1: [9, 2, 14, 0, 7, 11, 3, 5, 12, 1],
    2: [4, 13, 6, 10, 8, 15],
}


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(CONFIG, dtype=torch.float64)


def prompt(request_id: int, length: int) -> np.ndarray:
    rng = np.random.default_rng(request_id)
    return rng.integers(0, CONFIG.vocab_size, size=length)


def run_step(
    model: TinyTransformer,
    pool: KVPool,
    entries: Sequence[tuple[int, int, np.ndarray]],
    num_generation: int = 0,
    all_logits: bool = True,
) -> torch.Tensor:
    """One forward over ``(request_id, start, tokens)`` entries; logits of every token."""
    ids = [e[0] for e in entries]
    width = max(len(TABLES[i]) for i in ids)
    table = np.full((len(ids), width), -1)
    for row, request_id in enumerate(ids):
        table[row, : len(TABLES[request_id])] = TABLES[request_id]
    counts = [len(e[2]) for e in entries]
    sample = np.arange(sum(counts)) if all_logits else None
    plan = StepPlan.from_arrays(
        PLACEMENT,
        ids,
        [e[1] for e in entries],
        [e[2] for e in entries],
        table,
        num_generation=num_generation,
        sample_index=sample,
    )
    batch = pool.prepare(plan)
    hidden = model.forward(batch, pool)
    return model.logits(hidden[batch.sample_index])


def kv_of(pool: KVPool, request_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    table = np.asarray(TABLES[request_id])
    pos = np.arange(length)
    slots = torch.as_tensor(table[pos // TPB] * TPB + pos % TPB)
    keys = torch.stack([pool.read_tokens(layer, slots)[0] for layer in range(CONFIG.num_layers)])
    values = torch.stack([pool.read_tokens(layer, slots)[1] for layer in range(CONFIG.num_layers)])
    return keys, values


def new_pool(model: TinyTransformer) -> KVPool:
    return model.new_kv_pool(PLACEMENT, capacity_superblocks=16)


@pytest.mark.parametrize("chunks", [[8, 8, 21], [4, 4, 4, 4, 4, 4, 4, 4, 4, 1], [36, 1], [5, 32]])
def test_chunked_prefill_matches_unchunked(model, chunks):
    tokens = prompt(1, 37)
    whole_pool, chunked_pool = new_pool(model), new_pool(model)
    whole = run_step(model, whole_pool, [(1, 0, tokens)])
    pieces: list[torch.Tensor] = []
    start = 0
    for length in chunks:
        pieces.append(run_step(model, chunked_pool, [(1, start, tokens[start : start + length])]))
        start += length
    torch.testing.assert_close(torch.cat(pieces), whole, atol=TOL, rtol=TOL)
    for got, want in zip(kv_of(chunked_pool, 1, 37), kv_of(whole_pool, 1, 37)):
        torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


def test_decode_steps_match_prefill(model):
    tokens = prompt(2, 23)
    whole = run_step(model, new_pool(model), [(2, 0, tokens)])
    pool = new_pool(model)
    pieces = [run_step(model, pool, [(2, 0, tokens[:18])])]
    for pos in range(18, 23):
        pieces.append(run_step(model, pool, [(2, pos, tokens[pos : pos + 1])], num_generation=1))
    torch.testing.assert_close(torch.cat(pieces), whole, atol=TOL, rtol=TOL)


def test_mixed_step_matches_separate_steps(model):
    """A decode entry and a context chunk of another request in one step (two groups)."""
    first, second = prompt(1, 30), prompt(2, 19)
    separate = new_pool(model)
    run_step(model, separate, [(1, 0, first[:29])])
    want_decode = run_step(model, separate, [(1, 29, first[29:])], num_generation=1)
    run_step(model, separate, [(2, 0, second[:8])])
    want_chunk = run_step(model, separate, [(2, 8, second[8:])])

    mixed = new_pool(model)
    run_step(model, mixed, [(1, 0, first[:29]), (2, 0, second[:8])])
    got = run_step(model, mixed, [(1, 29, first[29:]), (2, 8, second[8:])], num_generation=1)
    torch.testing.assert_close(got, torch.cat([want_decode, want_chunk]), atol=TOL, rtol=TOL)


def test_batched_prefill_of_uneven_requests_matches_one_by_one(model):
    first, second = prompt(1, 33), prompt(2, 6)
    alone_first = run_step(model, new_pool(model), [(1, 0, first)])
    alone_second = run_step(model, new_pool(model), [(2, 0, second)])
    together = run_step(model, new_pool(model), [(1, 0, first), (2, 0, second)])
    torch.testing.assert_close(together, torch.cat([alone_first, alone_second]), atol=TOL, rtol=TOL)


def test_weights_are_deterministic_and_seeded():
    a, b = TinyTransformer(CONFIG), TinyTransformer(CONFIG)
    c = TinyTransformer(TinyConfig(num_layers=3, seed=1235))
    assert torch.equal(a.embedding, b.embedding)
    assert torch.equal(a.layers[2]["w_down"], b.layers[2]["w_down"])
    assert not torch.equal(a.embedding, c.embedding)
    tied = TinyTransformer(TinyConfig(tie_embeddings=True))
    assert torch.equal(tied.lm_head, tied.embedding.t())


def test_float32_model_is_close_to_float64(model):
    tokens = prompt(1, 37)
    want = run_step(model, new_pool(model), [(1, 0, tokens)])
    low = TinyTransformer(CONFIG, dtype=torch.float32)
    got = run_step(low, low.new_kv_pool(PLACEMENT, 16), [(1, 0, tokens)])
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_paged_forward_matches_dense_reference(model):
    tokens = prompt(1, 37)
    pool = new_pool(model)
    paged = torch.cat(
        [
            run_step(model, pool, [(1, 0, tokens[:13])]),
            run_step(model, pool, [(1, 13, tokens[13:])]),
        ]
    )
    torch.testing.assert_close(paged, dense_logits(model, tokens), atol=TOL, rtol=TOL)
