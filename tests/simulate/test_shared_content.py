"""Prompts that share content: synthetic shared system prompts and conversations, a trace's
``token_ids`` and ``hash_ids`` (and every hostile form of them), and the round trip through
``write_trace``."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from helix_kv.simulate import (  # the package exports the content classes too
    HashBlocks,
    PromptParts,
    PromptTokens,
    RequestSpec,
    TraceError,
    WorkloadSpec,
    read_trace,
    synthetic_workload,
    write_trace,
)
from helix_kv.simulate.tokens import (
    VOCAB_SIZE,
    expected_output,
    hash_block_tokens,
    prompt_tokens,
    shared_prefix_tokens,
    user_tokens,
)
from helix_kv.simulate.workload import (
    DEFAULT_HASH_BLOCK_TOKENS,
    OWN_PROMPT_SALT,
    Segment,
    SegmentKind,
    parse_trace,
)


def _strip(request: RequestSpec, prefix: int = 0) -> tuple[int, int, int, int, int, int | None]:
    return (
        request.request_id,
        request.arrival_step,
        request.prompt_len - prefix,
        request.output_len,
        request.priority,
        request.abort_step,
    )


# --- synthetic: a shared system prompt ------------------------------------------------------


def test_shared_prefix_prepends_one_system_prompt_and_changes_nothing_else() -> None:
    plain = synthetic_workload(WorkloadSpec(num_requests=60, seed=4, abort_rate=0.2))
    spec = WorkloadSpec(num_requests=60, seed=4, abort_rate=0.2, shared_prefix_len=300)
    shared = synthetic_workload(spec)
    assert shared == synthetic_workload(spec)  # a pure function of the spec
    # the drawn figures are those of the plain workload, the prompt 300 tokens longer
    assert [_strip(r, 300) for r in shared] == [_strip(r) for r in plain]
    system = shared_prefix_tokens(0, 300)
    for request in shared:
        assert isinstance(request.content, PromptParts)
        prompt = request.prompt()
        assert prompt.dtype == np.int32
        assert len(prompt) == request.prompt_len
        assert np.array_equal(prompt[:300], system)
        assert np.array_equal(
            prompt[300:], user_tokens(request.request_id, request.prompt_len - 300)
        )
        assert request.cache_salt is None  # shares with the others
    assert all(r.content is None for r in plain)


def test_shared_prefix_share_picks_a_seeded_fraction() -> None:
    spec = WorkloadSpec(num_requests=2000, seed=2, shared_prefix_len=64, shared_prefix_share=0.3)
    workload = synthetic_workload(spec)
    sharing = [r for r in workload if r.content is not None]
    assert abs(len(sharing) / 2000 - 0.3) < 0.04
    # the others keep a prompt of their own, as without the flag
    plain = synthetic_workload(WorkloadSpec(num_requests=2000, seed=2))
    for request, before in zip(workload, plain):
        if request.content is None:
            assert request == before
            assert request.cache_salt == OWN_PROMPT_SALT + request.request_id.to_bytes(8, "little")
    none = synthetic_workload(
        WorkloadSpec(num_requests=50, shared_prefix_len=64, shared_prefix_share=0.0)
    )
    assert none == synthetic_workload(WorkloadSpec(num_requests=50))


def test_workload_description_names_the_new_knobs_only_when_on() -> None:
    assert "shared_prefix_len" not in WorkloadSpec().to_dict()
    assert "turns" not in WorkloadSpec().to_dict()
    described = WorkloadSpec(shared_prefix_len=8, shared_prefix_share=0.5, turns=3).to_dict()
    assert described["shared_prefix_len"] == 8
    assert described["shared_prefix_share"] == 0.5
    assert described["turns"] == 3
    assert described["think_steps"] == WorkloadSpec().think_steps


# --- synthetic: conversations ---------------------------------------------------------------


def test_turns_extend_the_previous_prompt_with_its_answer_and_new_tokens() -> None:
    spec = WorkloadSpec(num_requests=40, seed=6, turns=4, think_steps=5, shared_prefix_len=32)
    workload = synthetic_workload(spec)
    assert workload == synthetic_workload(spec)
    assert [r.request_id for r in workload] == list(range(40))  # ids in arrival order
    arrivals = [r.arrival_step for r in workload]
    assert arrivals == sorted(arrivals)
    by_id = {r.request_id: r for r in workload}
    turns_seen = 0
    for request in workload:
        assert isinstance(request.content, PromptParts)
        segments = request.content.segments
        assert segments[0] == Segment(SegmentKind.SHARED, 0, 32)
        assert segments[-1] == Segment(SegmentKind.USER, request.request_id, segments[-1].length)
        if len(segments) == 2:
            continue  # a first turn
        turns_seen += 1
        answer = segments[-2]
        assert answer.kind is SegmentKind.ANSWER
        previous = by_id[answer.source]
        # turn t = turn t-1's prompt + its answer (its whole output) + new user tokens
        assert answer.length == previous.output_len
        prompt = request.prompt()
        assert np.array_equal(prompt[: previous.prompt_len], previous.prompt())
        answer_at = previous.prompt_len
        assert np.array_equal(
            prompt[answer_at : answer_at + previous.output_len],
            expected_output(previous.request_id, previous.output_len),
        )
        # it arrives once the previous turn could have finished, and a think gap later
        assert request.arrival_step >= previous.arrival_step + previous.output_len
    assert turns_seen == 30  # 10 conversations of 4 turns


def test_turns_group_requests_and_the_last_conversation_may_be_shorter() -> None:
    workload = synthetic_workload(WorkloadSpec(num_requests=10, seed=1, turns=4))
    firsts = [r for r in workload if len(r.content.segments) == 1]  # type: ignore[union-attr]
    assert len(firsts) == 3  # 4 + 4 + 2
    longest = max(len(r.content.segments) for r in workload)  # type: ignore[union-attr]
    assert longest == 7  # user, then (answer, user) three times
    # no shared system prompt: each conversation is its own, first turns share nothing
    assert all(r.content.segments[0].kind is SegmentKind.USER for r in workload)  # type: ignore[union-attr]


def test_think_steps_zero_arrives_at_the_earliest_finish() -> None:
    workload = synthetic_workload(
        WorkloadSpec(num_requests=6, seed=3, turns=3, think_steps=0, arrival_rate=0)
    )
    by_id = {r.request_id: r for r in workload}
    for request in workload:
        segments = request.content.segments  # type: ignore[union-attr]
        if len(segments) > 1:
            previous = by_id[segments[-2].source]
            assert request.arrival_step == previous.arrival_step + previous.output_len


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"shared_prefix_len": -1}, "shared prefix len must be >= 0, got -1"),
        ({"shared_prefix_share": 1.5}, r"shared prefix share must be in \[0, 1\], got 1.5"),
        ({"shared_prefix_share": float("nan")}, "shared prefix share"),
        ({"turns": 0}, "turns must be >= 1, got 0"),
        ({"think_steps": -1.0}, r"think steps must be in \[0, 1000000000\], got -1.0"),
        ({"think_steps": float("inf")}, "think steps"),
    ],
)
def test_bad_shared_content_spec(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadSpec(**change).validate()


# --- content: compact, immutable, compared by tokens -------------------------------------


def test_contents_are_hashable_picklable_and_equal_by_their_tokens() -> None:
    workload = synthetic_workload(WorkloadSpec(num_requests=12, turns=3, shared_prefix_len=20))
    assert len(set(workload)) == 12
    assert pickle.loads(pickle.dumps(workload)) == workload  # what --procs sends each rank
    request = workload[-1]
    assert request.content is not None
    as_tokens = PromptTokens.of(request.prompt())
    assert as_tokens == request.content
    assert hash(as_tokens) == hash(request.content)
    assert PromptTokens.of([1, 2, 3]) != PromptTokens.of([1, 2, 4])
    assert repr(PromptTokens.of([1, 2, 3])) == "PromptTokens(3 tokens: [1, 2, 3])"
    with pytest.raises(ValueError, match="its content has 3 tokens, its prompt_len is 4"):
        RequestSpec(1, 0, 4, 1, content=PromptTokens.of([1, 2, 3]))


def test_mixed_tokens_are_in_the_vocabulary_and_differ_by_source() -> None:
    for tokens in (shared_prefix_tokens(0, 500), user_tokens(7, 500)):
        assert tokens.dtype == np.int32
        assert ((tokens >= 0) & (tokens < VOCAB_SIZE)).all()
    assert not np.array_equal(user_tokens(1, 8), user_tokens(1 + VOCAB_SIZE, 8))
    # prompt_tokens repeats for ids VOCAB_SIZE apart: why such prompts get salts of their own
    assert np.array_equal(prompt_tokens(1, 8), prompt_tokens(1 + VOCAB_SIZE, 8))
    assert RequestSpec(1, 0, 8, 1).cache_salt != RequestSpec(1 + VOCAB_SIZE, 0, 8, 1).cache_salt


# --- traces: token_ids and hash_ids -----------------------------------------------------------

BASE = {"id": 1, "arrival_step": 0, "output_len": 2}


def _line(**fields: object) -> str:
    return json.dumps({**BASE, **fields})


def test_trace_token_ids_are_the_prompt_and_prompt_len_is_optional() -> None:
    (request,) = parse_trace([_line(token_ids=[5, 6, 7])])
    assert request.prompt_len == 3
    assert request.prompt().tolist() == [5, 6, 7]
    assert request.cache_salt is None
    (same,) = parse_trace([_line(token_ids=[5, 6, 7], prompt_len=3)])
    assert same == request
    (none,) = parse_trace([_line(token_ids=None, prompt_len=3)])  # null: not given
    assert none.content is None
    (top,) = parse_trace([_line(token_ids=[0, 2**31 - 1])])
    assert top.prompt().tolist() == [0, 2**31 - 1]


def test_trace_hash_ids_stand_for_the_same_tokens_wherever_they_appear() -> None:
    lines = [
        _line(id=1, prompt_len=1000, hash_ids=[10, 11]),
        _line(id=2, prompt_len=1100, hash_ids=[10, 11, 12]),
        _line(id=3, prompt_len=600, hash_ids=[13, 11]),
        _line(id=4, prompt_len=5, hash_ids=[2**64 - 1]),
    ]
    first, second, third, fourth = parse_trace(lines)
    assert isinstance(first.content, HashBlocks)
    assert first.content.hash_ids == (10, 11)
    assert first.content.block_tokens == DEFAULT_HASH_BLOCK_TOKENS
    a, b, c = first.prompt(), second.prompt(), third.prompt()
    assert (len(a), len(b), len(c)) == (1000, 1100, 600)
    assert np.array_equal(a, b[:1000])  # the shared blocks, the last one cut to prompt_len
    assert np.array_equal(a[512:600], c[512:])  # block 11, wherever it stands
    assert not np.array_equal(a[:512], c[:512])  # 10 and 13 are other blocks
    assert np.array_equal(a, hash_block_tokens(np.array([10, 11]), 512, 1000))
    assert len(fourth.prompt()) == 5
    # blocks of another size
    (small,) = parse_trace([_line(prompt_len=40, hash_ids=[1, 2, 3])], hash_block_tokens=16)
    assert small.content == HashBlocks.of([1, 2, 3], 16, 40)


IN_I32 = "must be a token id in [0, 2147483647]"
IN_U64 = "must be a hash id in [0, 18446744073709551615]"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"token_ids": [1, 2], "prompt_len": 3}, "'prompt_len' (3) must be the number of"),
        ({"token_ids": []}, "'token_ids' must not be empty"),
        ({"token_ids": "1 2 3"}, "'token_ids' must be a list of token ids, got \"1 2 3\""),
        ({"token_ids": {"0": 1}}, "'token_ids' must be a list of token ids, got {\"0\": 1}"),
        ({"token_ids": 5}, "'token_ids' must be a list of token ids, got 5"),
        ({"token_ids": [1, 2.5]}, "'token_ids' entry 1 must be an integer, got 2.5"),
        ({"token_ids": [1, 2.0]}, "'token_ids' entry 1 must be an integer, got 2.0"),
        ({"token_ids": [1, True]}, "'token_ids' entry 1 must be an integer, got true"),
        ({"token_ids": [False]}, "'token_ids' entry 0 must be an integer, got false"),
        ({"token_ids": [None]}, "'token_ids' entry 0 must be an integer, got null"),
        ({"token_ids": ["7"]}, "'token_ids' entry 0 must be an integer, got \"7\""),
        ({"token_ids": [[1]]}, "'token_ids' entry 0 must be an integer, got [1]"),
        ({"token_ids": [1, 2**31]}, f"'token_ids' entry 1 {IN_I32}, got 2147483648"),
        ({"token_ids": [-1]}, f"'token_ids' entry 0 {IN_I32}, got -1"),
        ({"token_ids": [10**40]}, f"'token_ids' entry 0 {IN_I32}, got 1000000"),
        ({"token_ids": [1], "prompt_len": True}, "'prompt_len' must be an integer, got true"),
        ({"token_ids": [1], "hash_ids": [1]}, "give the prompt as 'token_ids' or as 'hash_ids'"),
        ({"hash_ids": [1, 2]}, "missing key 'prompt_len'"),
        ({"hash_ids": [], "prompt_len": 4}, "'hash_ids' must not be empty"),
        ({"hash_ids": "ab", "prompt_len": 4}, "'hash_ids' must be a list of hash ids, got \"ab\""),
        ({"hash_ids": [1.0], "prompt_len": 4}, "'hash_ids' entry 0 must be an integer, got 1.0"),
        ({"hash_ids": [True], "prompt_len": 4}, "'hash_ids' entry 0 must be an integer, got true"),
        ({"hash_ids": [-3], "prompt_len": 4}, f"'hash_ids' entry 0 {IN_U64}, got -3"),
        ({"hash_ids": [2**64], "prompt_len": 4}, f"'hash_ids' entry 0 {IN_U64}, got 1844"),
        ({"hash_ids": [1, 2], "prompt_len": 512}, "'hash_ids' has 2 ids; a 'prompt_len' of 512"),
        ({"hash_ids": [1, 2], "prompt_len": 5}, "in blocks of 512 tokens (--hash-block-tokens)"),
        ({"hash_ids": [1], "prompt_len": 513}, "takes 2"),
        ({"hash_ids": [1], "prompt_len": 0}, "'prompt_len' must be in [1,"),
    ],
)  # fmt: skip
def test_bad_prompt_content_names_the_line_and_the_reason(fields: dict, reason: str) -> None:
    good = _line(id=9, prompt_len=4)
    with pytest.raises(TraceError) as caught:
        parse_trace([good, "", _line(**fields)], "t.jsonl")
    message = str(caught.value)
    assert message.startswith("trace t.jsonl line 3: "), message
    assert reason in message
    assert caught.value.line_number == 3
    assert "\n" not in message
    assert len(message) < 200  # a huge value is cut, the line stays short


def test_a_huge_bad_list_is_reported_short_and_deep_nesting_is_a_trace_error() -> None:
    with pytest.raises(TraceError, match=r"entry 100000 must be an integer, got \"x\""):
        parse_trace([_line(token_ids=[1] * 100_000 + ["x"])])
    with pytest.raises(
        TraceError, match=r"must be a list of token ids, got \{\"a\": \[\[.*\.\.\.$"
    ):
        parse_trace([_line(token_ids={"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]})])
    with pytest.raises(TraceError, match="line 1: not valid JSON"):
        parse_trace(["[" * 100_000 + "]" * 100_000])


# --- the round trip ---------------------------------------------------------------------------


def test_write_trace_round_trips_synthetic_content_as_token_ids(tmp_path: Path) -> None:
    workload = synthetic_workload(
        WorkloadSpec(
            num_requests=30, seed=5, turns=3, shared_prefix_len=40, shared_prefix_share=0.5
        )
    )
    path = tmp_path / "trace.jsonl"
    write_trace(workload, path)
    assert read_trace(path) == workload
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record, request in zip(records, workload):
        assert record["token_ids"] == request.prompt().tolist()
        assert record["prompt_len"] == request.prompt_len
        assert "hash_ids" not in record
    # a prompt of its own stays without content
    plain = synthetic_workload(
        WorkloadSpec(num_requests=5, shared_prefix_len=8, shared_prefix_share=0)
    )
    write_trace(plain, path)
    assert all("token_ids" not in json.loads(line) for line in path.read_text().splitlines())
    assert read_trace(path) == plain


def test_write_trace_keeps_hash_ids(tmp_path: Path) -> None:
    lines = [
        _line(id=1, prompt_len=1000, hash_ids=[10, 11]),
        _line(id=2, arrival_step=3, token_ids=[4, 5]),
        _line(id=3, arrival_step=4, prompt_len=7),
    ]
    workload = parse_trace(lines)
    path = tmp_path / "trace.jsonl"
    write_trace(workload, path)
    assert read_trace(path) == workload
    first, second, third = (json.loads(line) for line in path.read_text().splitlines())
    assert first["hash_ids"] == [10, 11]
    assert "token_ids" not in first
    assert second["token_ids"] == [4, 5]
    assert not {"token_ids", "hash_ids"} & set(third)
    # blocks of another size than the one written: their tokens, still equal
    write_trace(workload, path, hash_block_tokens=256)
    assert "token_ids" in path.read_text().splitlines()[0]
    assert read_trace(path) == workload
    small = parse_trace([_line(prompt_len=40, hash_ids=[1, 2, 3])], hash_block_tokens=16)
    write_trace(small, path, hash_block_tokens=16)
    assert read_trace(path, hash_block_tokens=16) == small
