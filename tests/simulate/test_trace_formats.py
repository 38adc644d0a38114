"""The public trace formats (``simulate.trace_formats``): each read against hand-computed
requests from the fixtures in ``fixtures/``, their detection, bad rows named by line and field,
the skipped rows counted, and the window, limit and time scale; then the CLI, as a subprocess."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helix_kv.errors import TraceError
from helix_kv.simulate import workload
from helix_kv.simulate.trace_formats import (
    TraceFormat,
    TraceSelection,
    detect_format,
    parse_trace_lines,
    read_trace_file,
)
from helix_kv.simulate.workload import HashBlocks, RequestSpec

from ..helpers.cli import run_command
from ..helpers.scheduler import needs_scheduler

FIXTURES = Path(__file__).parent / "fixtures"


def fixture(name: str) -> Path:
    return FIXTURES / name


def shape(requests: list[RequestSpec]) -> list[tuple[int, float | None, int, int]]:
    """``(id, arrival_ms, prompt_len, output_len)`` of each request, in queue order."""
    return [(r.request_id, r.arrival_ms, r.prompt_len, r.output_len) for r in requests]


def arrivals(requests: list[RequestSpec]) -> list[float]:
    return [r.arrival_ms for r in requests if r.arrival_ms is not None]


# --- each format, against the fixture's rows worked out by hand --------------------------------


def test_azure_2023_rows_sorted_numbered_in_file_order_and_skipped_counted() -> None:
    read = read_trace_file(fixture("azure_2023.csv"))
    assert (read.trace_format, read.detected, read.rows) == (TraceFormat.AZURE, True, 6)
    # rows 3 (0 generated) and 4 (0 context) are skipped; the kept rows 1, 2, 5, 6 are ids
    # 0..3 in file order and run by time: row 5 (18:15:48.18) comes before row 2
    assert read.skipped == {"zero_response_tokens": 1, "zero_prompt_tokens": 1}
    assert [r.request_id for r in read.requests] == [0, 2, 1, 3]
    assert arrivals(read.requests) == pytest.approx([0.0, 1500.0, 4314.579, 73319.41])
    assert [(r.prompt_len, r.output_len) for r in read.requests] == [
        (374, 44),
        (512, 12),
        (396, 109),
        (20, 5),
    ]
    assert all(r.arrival_step == 0 and r.content is None for r in read.requests)


def test_azure_2024_timestamps_with_an_offset() -> None:
    read = read_trace_file(fixture("azure_2024.csv"))
    assert read.trace_format is TraceFormat.AZURE
    assert shape(read.requests) == [
        (0, pytest.approx(0.0), 1020, 25),
        (1, pytest.approx(502.07), 88, 310),
        (2, pytest.approx(1000.0), 4096, 1),
    ]


@pytest.mark.parametrize(
    ("stamps", "expected_ms"),
    [
        # past midnight into the next day
        (["2024-05-10 23:59:59.500000+00:00", "2024-05-11 00:00:00.250000+00:00"], [0, 750]),
        # one offset for all: the same times as UTC
        (["2024-05-10 02:00:00+02:00", "2024-05-10 02:00:03.5+02:00"], [0, 3500]),
        # two offsets: 02:00:02+02:00 is 00:00:02 UTC
        (["2024-05-10 00:00:01+00:00", "2024-05-10 02:00:02+02:00"], [0, 1000]),
        # no offset (the 2023 form, 7 fractional digits) and a T between date and time
        (["2023-11-16T18:15:46.6805900", "2023-11-16 18:15:46.6806900"], [0, 0.1]),
    ],
)
def test_azure_times_across_days_and_offsets(stamps: list[str], expected_ms: list[float]) -> None:
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{s},10,2\n" for s in stamps)
    read = parse_trace_lines(io.StringIO(text), "t.csv")
    assert arrivals(read.requests) == pytest.approx(expected_ms, abs=1e-6)


def test_burstgpt_seconds_and_failures_skipped() -> None:
    read = read_trace_file(fixture("burstgpt.csv"))
    assert (read.trace_format, read.rows) == (TraceFormat.BURSTGPT, 6)
    # 46 s and 130.5 s have 0 response tokens (failures), 60 s has 0 request tokens
    assert read.skipped == {"zero_response_tokens": 2, "zero_prompt_tokens": 1}
    assert shape(read.requests) == [
        (0, 0.0, 472, 18),
        (1, 40000.0, 1087, 230),
        (2, 113000.0, 417, 276),
    ]


def test_a_burstgpt_log_type_naming_a_failure_is_skipped() -> None:
    # The published files mark a failure by 0 response tokens; a Log Type naming one counts too.
    text = (
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "1,ChatGPT,10,5,15,Conversation log\n"
        "2,ChatGPT,10,5,15,Failed\n"
        "3,ChatGPT,10,0,10,API log failure\n"  # both: counted under the first reason
    )
    read = parse_trace_lines(io.StringIO(text), "b.csv")
    assert read.skipped == {"failed_log_type": 2}
    assert shape(read.requests) == [(0, 0.0, 10, 5)]


def test_burstgpt_with_session_columns_and_no_log_type() -> None:
    text = (
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens\n"
        "10,a,3.5,GPT-4,100,20\n"
        "12.25,a,4.0,GPT-4,140,7\n"
    )
    read = parse_trace_lines(io.StringIO(text), "b.csv")
    assert read.trace_format is TraceFormat.BURSTGPT
    assert shape(read.requests) == [(0, 0.0, 100, 20), (1, 2250.0, 140, 7)]


def test_mooncake_rows_and_their_hash_ids() -> None:
    read = read_trace_file(fixture("mooncake.jsonl"))
    assert (read.trace_format, read.rows) == (TraceFormat.MOONCAKE, 5)
    assert read.skipped == {"zero_response_tokens": 1}  # the line at 30000 ms
    assert shape(read.requests) == [
        (0, 0.0, 655, 52),
        (1, 10535.0, 672, 26),
        (2, 27482.0, 1100, 52),
        (3, 31000.0, 512, 9),
    ]
    assert read.requests[2].content == HashBlocks.of([46, 48, 49], 512, 1100)


def test_mooncake_requests_sharing_hash_ids_share_those_tokens() -> None:
    first, second, third, fourth = read_trace_file(fixture("mooncake.jsonl")).requests
    a, b, c, d = (request.prompt() for request in (first, second, third, fourth))
    # ids 46, 47 in both: 512 tokens of 46, then 47 cut to 655 - 512 and 672 - 512 tokens
    assert np.array_equal(a, b[:655])
    assert not np.array_equal(a, c[:655])  # 46 then 48: only the first block is shared
    assert np.array_equal(a[:512], c[:512])
    assert fourth.content == HashBlocks.of([46], 512, 512)
    assert np.array_equal(d, a[:512])
    assert first.cache_salt is None  # content given: the prefix cache may share it


def test_mooncake_hash_block_tokens_apply() -> None:
    text = '{"timestamp": 5, "input_length": 300, "output_length": 4, "hash_ids": [7, 8, 9]}\n'
    read = parse_trace_lines([text], "m.jsonl", hash_block_tokens=128)
    assert read.requests[0].content == HashBlocks.of([7, 8, 9], 128, 300)
    with pytest.raises(TraceError) as caught:
        read_trace_file(fixture("mooncake.jsonl"), hash_block_tokens=256)
    assert str(caught.value) == (
        f"trace {fixture('mooncake.jsonl')} line 1: 'hash_ids' has 2 ids; an 'input_length' of "
        "655 in blocks of 256 tokens (--hash-block-tokens) takes 3 (format mooncake, detected "
        "from line 1)"
    )


def test_mooncake_without_hash_ids_has_prompts_of_their_own() -> None:
    read = parse_trace_lines(['{"timestamp": 1.5, "input_length": 9, "output_length": 2}\n'])
    (request,) = read.requests
    assert request.content is None
    assert request.cache_salt is not None


def test_helix_traces_read_as_before() -> None:
    lines = [
        '{"id": 7, "arrival_step": 4, "prompt_len": 8, "output_len": 2}\n',
        '{"id": 3, "arrival_step": 1, "prompt_len": 8, "output_len": 2, "prio": 1}\n',
    ]
    read = parse_trace_lines(lines, "h.jsonl")
    assert read.trace_format is TraceFormat.HELIX
    assert read.requests == workload.parse_trace(lines, "h.jsonl")
    assert read.unknown_keys == {"prio": 2}
    limited = parse_trace_lines(lines, "h.jsonl", selection=TraceSelection(limit=1))
    assert [r.request_id for r in limited.requests] == [3]
    with pytest.raises(TraceError, match="arrive at steps, not times"):
        parse_trace_lines(lines, "h.jsonl", selection=TraceSelection(time_scale=2.0))


def test_a_timed_helix_trace_keeps_its_times_unless_a_time_option_moves_them() -> None:
    lines = [
        '{"id": 5, "arrival_ms": 100, "prompt_len": 8, "output_len": 2, "abort_ms": 900}\n',
        '{"id": 6, "arrival_s": 2.1, "prompt_len": 8, "output_len": 2}\n',
        '{"id": 7, "arrival_ms": 4100, "prompt_len": 8, "output_len": 2}\n',
    ]
    as_written = parse_trace_lines(lines, "h.jsonl").requests
    assert as_written == workload.parse_trace(lines, "h.jsonl")
    assert arrivals(as_written) == [100.0, 2100.0, 4100.0]
    # the window [1, 5) s after the earliest row keeps 6 and 7; 6 is then time 0, scaled by 2
    selection = TraceSelection(time_scale=2.0, window_s=(1.0, 5.0))
    moved = parse_trace_lines(lines, "h.jsonl", selection=selection).requests
    assert [(r.request_id, r.arrival_ms) for r in moved] == [(6, 0.0), (7, 4000.0)]
    whole = parse_trace_lines(lines, "h.jsonl", selection=TraceSelection(time_scale=0.5))
    assert [(r.arrival_ms, r.abort_ms) for r in whole.requests] == [
        (0.0, 400.0),  # the abort keeps its distance after the arrival, scaled
        (1000.0, None),
        (2000.0, None),
    ]


# --- detection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("azure_2023.csv", TraceFormat.AZURE),
        ("azure_2024.csv", TraceFormat.AZURE),
        ("burstgpt.csv", TraceFormat.BURSTGPT),
        ("mooncake.jsonl", TraceFormat.MOONCAKE),
    ],
)
def test_each_fixture_is_detected(name: str, expected: TraceFormat) -> None:
    first_line = fixture(name).read_text(encoding="utf-8").splitlines()[0]
    assert detect_format(first_line) is expected
    assert read_trace_file(fixture(name), "auto").trace_format is expected
    assert read_trace_file(fixture(name), expected).detected is False


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"id": 0, "arrival_step": 0, "prompt_len": 5, "output_len": 1}', TraceFormat.HELIX),
        ('{"id": 0}', TraceFormat.HELIX),  # the helix reader names what is missing
        ("{not json", TraceFormat.HELIX),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', TraceFormat.MOONCAKE),
        # a helix key says helix, whatever else the line holds
        ('{"id": 0, "input_length": 5}', TraceFormat.HELIX),
        ("\ufeffTIMESTAMP,ContextTokens,GeneratedTokens", TraceFormat.AZURE),
        ("Timestamp,Request tokens,Response tokens", TraceFormat.BURSTGPT),
        ("time,prompt,output", None),
        ("hello", None),
    ],
)
def test_detect_format_from_a_first_line(line: str, expected: TraceFormat | None) -> None:
    assert detect_format(line) is expected


def test_a_first_line_of_no_format_is_an_error_naming_the_choices() -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace_lines(["\n", "time,prompt,output\n", "1,2,3\n"], "x.csv")
    assert str(caught.value) == (
        'trace x.csv line 2: cannot tell its format from line 2 ("time,prompt,output"): not a '
        "helix or mooncake JSON line, nor an azure or burstgpt CSV header; name it (helix, "
        "azure, mooncake, burstgpt)"
    )


def test_an_empty_trace_has_no_requests() -> None:
    for trace_format in TraceFormat:
        with pytest.raises(TraceError, match="no requests"):
            parse_trace_lines(["\n"], "e", trace_format)
    with pytest.raises(TraceError, match="no requests"):
        parse_trace_lines(["TIMESTAMP,ContextTokens,GeneratedTokens\n"], "e")


# --- bad rows and wrong formats ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "azure_bad_timestamp.csv",
            "line 3: 'TIMESTAMP' must be a date and time such as 2023-11-16 18:15:46.6805900, "
            'got "2023-11-16 18:61:50.9951690" (format azure, detected from line 1)',
        ),
        (
            "azure_negative_tokens.csv",
            "line 4: 'ContextTokens' must be a whole number of tokens >= 0, got \"-5\" "
            "(format azure, detected from line 1)",
        ),
        (
            "burstgpt_missing_column.csv",
            "line 3: the row has 3 fields; it lacks 'Response tokens' (format burstgpt, "
            "detected from line 1)",
        ),
        (
            "mooncake_non_integer_tokens.jsonl",
            "line 2: 'input_length' must be a whole number of tokens >= 0, got 12.5 (format "
            "mooncake, detected from line 1)",
        ),
    ],
)
def test_a_bad_fixture_row_is_named_by_file_line_and_field(name: str, message: str) -> None:
    with pytest.raises(TraceError) as caught:
        read_trace_file(fixture(name))
    assert str(caught.value) == f"trace {fixture(name)} {message}"
    assert caught.value.line_number == int(message.split()[1].rstrip(":"))


AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
BURST_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
MOONCAKE_GOOD = '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (AZURE_HEAD + "2023-11-16 18:15:47,12.5,3\n", "'ContextTokens' must be a whole number"),
        (AZURE_HEAD + "2023-11-16 18:15:47,12,abc\n", "'GeneratedTokens' must be a whole"),
        (AZURE_HEAD + "2023-11-16 18:15:47,2000000,3\n", "'ContextTokens' is 2000000 tokens"),
        (AZURE_HEAD + "today,12,3\n", "'TIMESTAMP' must be a date and time"),
        (AZURE_HEAD + "NaT,12,3\n", "'TIMESTAMP' must be a date and time"),
        (AZURE_HEAD + "2023-02-30 00:00:00,12,3\n", "'TIMESTAMP' must be a date and time"),
        (AZURE_HEAD + "99999-02-03 00:00:00,12,3\n", "'TIMESTAMP' must be a date and time"),
        (AZURE_HEAD + "2023-11-16 18:15:47\n", "the row has 1 field; it lacks 'ContextTokens', "),
        (BURST_HEAD + "x,ChatGPT,1,2,3,API log\n", "'Timestamp' must be a number of seconds"),
        (BURST_HEAD + "-3,ChatGPT,1,2,3,API log\n", "'Timestamp' must be a number of seconds"),
        (BURST_HEAD + "nan,ChatGPT,1,2,3,API log\n", "'Timestamp' must be a number of seconds"),
        (BURST_HEAD + "3,ChatGPT,1,-2,3,API log\n", "'Response tokens' must be a whole number"),
        (MOONCAKE_GOOD + '{"timestamp": -1, "input_length": 5, "output_length": 1}\n', ">= 0"),
        (MOONCAKE_GOOD + '{"timestamp": "0", "input_length": 5, "output_length": 1}\n', "ms"),
        (MOONCAKE_GOOD + '{"timestamp": 1, "input_length": true, "output_length": 1}\n', "whole"),
        (MOONCAKE_GOOD + '{"timestamp": 1, "input_length": 5, "output_length": -1}\n', "whole"),
        (MOONCAKE_GOOD + '{"timestamp": 1, "input_length": 5}\n', "missing key 'output_length'"),
        (MOONCAKE_GOOD + '{"timestamp": 1, "input_length": 5, "output_length": 1, '
         '"hash_ids": [1, "x"]}\n', "'hash_ids' entry 1 must be an integer"),
        (MOONCAKE_GOOD + "[1]\n", "expected a JSON object, got list"),
    ],
)  # fmt: skip
def test_a_bad_row_is_named_by_its_line(text: str, reason: str) -> None:
    with pytest.raises(TraceError) as caught:
        parse_trace_lines(io.StringIO(text), "t")
    assert caught.value.line_number == 3 if text.startswith("TIMESTAMP") else 2
    assert reason in caught.value.reason
    assert "detected from line 1" in caught.value.reason


def test_the_first_bad_row_is_named_across_columns_and_chunks() -> None:
    rows = [f"2023-11-16 18:15:{i % 60:02d},{i},{i + 1}\n" for i in range(70_000)]
    rows[66_000] = "2023-11-16 18:15:00,5,x\n"  # the second chunk: its first bad row
    rows[67_000] = "bad,5,5\n"
    with pytest.raises(TraceError) as caught:
        parse_trace_lines(["TIMESTAMP,ContextTokens,GeneratedTokens\n", *rows], "big.csv")
    assert caught.value.line_number == 66_002
    assert "'GeneratedTokens'" in caught.value.reason


@pytest.mark.parametrize(
    ("name", "forced", "reason"),
    [
        (
            "burstgpt.csv",
            "azure",
            "the header lacks the columns 'TIMESTAMP', 'ContextTokens', 'GeneratedTokens' (it has "
            "'Timestamp', 'Model', 'Request tokens', 'Response tokens', 'Total tokens', 'Log "
            "Type'); it looks like format burstgpt (format azure, as given)",
        ),
        (
            "azure_2023.csv",
            "burstgpt",
            "the header lacks the columns 'Timestamp', 'Request tokens', 'Response tokens' (it "
            "has 'TIMESTAMP', 'ContextTokens', 'GeneratedTokens'); it looks like format azure "
            "(format burstgpt, as given)",
        ),
        (
            "azure_2023.csv",
            "mooncake",
            "not valid JSON (Expecting value at column 1) (format mooncake, as given)",
        ),
        (
            "mooncake.jsonl",
            "helix",
            "missing keys 'id', 'arrival_step', 'prompt_len', 'output_len' (the arrival may be "
            "in time instead: 'arrival_ms' or 'arrival_s') (format helix, as given)",
        ),
        ("mooncake.jsonl", "azure", "the header lacks the columns 'TIMESTAMP'"),
    ],
)
def test_a_forced_format_that_does_not_fit_is_named(name: str, forced: str, reason: str) -> None:
    with pytest.raises(TraceError) as caught:
        read_trace_file(fixture(name), forced)
    assert caught.value.line_number == 1
    assert caught.value.reason.startswith(reason)
    assert caught.value.reason.endswith(f"(format {forced}, as given)")


def test_a_wrong_guess_names_the_detected_format() -> None:
    lines = [MOONCAKE_GOOD, '{"id": 1, "arrival_step": 0, "prompt_len": 5, "output_len": 1}\n']
    with pytest.raises(TraceError) as caught:
        parse_trace_lines(lines, "m.jsonl")
    assert str(caught.value) == (
        "trace m.jsonl line 2: missing keys 'timestamp', 'input_length', 'output_length' "
        "(format mooncake, detected from line 1)"
    )


# --- window, limit and time scale ----------------------------------------------------------------


def test_window_keeps_the_rows_arriving_inside_it() -> None:
    # seconds after the earliest row (18:15:46.68): 1.5 (kept), 2.32 (0 generated), 4.31
    # (kept), 60.0 (0 context), 73.32 (out); kept rows 2 and 5 are ids 0, 1 in file order
    read = read_trace_file(fixture("azure_2023.csv"), selection=TraceSelection(window_s=(1, 70)))
    assert read.skipped == {"zero_response_tokens": 1, "zero_prompt_tokens": 1}
    assert shape(read.requests) == [(1, 0.0, 512, 12), (0, pytest.approx(2814.579), 396, 109)]
    assert read.rows == 6  # the file's rows, whatever the window


def test_time_scale_multiplies_every_arrival() -> None:
    selection = TraceSelection(time_scale=0.5, window_s=(1, 70))
    read = read_trace_file(fixture("azure_2023.csv"), selection=selection)
    assert arrivals(read.requests) == pytest.approx([0.0, 1407.2895])
    slow = read_trace_file(fixture("burstgpt.csv"), selection=TraceSelection(time_scale=3))
    assert arrivals(slow.requests) == [0.0, 120000.0, 339000.0]


def test_limit_keeps_the_first_requests_and_counts_the_skips_before_it() -> None:
    # by time: 0 (kept), 1.5 (kept), 2.32 (skipped), 4.31 (kept), ...
    two = read_trace_file(fixture("azure_2023.csv"), selection=TraceSelection(limit=2))
    assert [r.request_id for r in two.requests] == [0, 1]
    assert two.skipped == {}
    three = read_trace_file(fixture("azure_2023.csv"), selection=TraceSelection(limit=3))
    assert [r.request_id for r in three.requests] == [0, 2, 1]  # rows 2, 6, 3 in file order
    assert three.skipped == {"zero_response_tokens": 1}
    assert arrivals(three.requests) == pytest.approx([0.0, 1500.0, 4314.579])


def test_the_window_starts_the_clock_at_its_first_kept_request() -> None:
    # seconds after the earliest row (5 s): 40 (kept), 41 and 55 (skipped), 113 (kept), ...
    selection = TraceSelection(window_s=(39, 200), limit=2)
    read = read_trace_file(fixture("burstgpt.csv"), selection=selection)
    assert shape(read.requests) == [(0, 0.0, 1087, 230), (1, 73000.0, 417, 276)]
    assert read.skipped == {"zero_response_tokens": 1, "zero_prompt_tokens": 1}


def test_a_selection_that_leaves_nothing_is_an_error() -> None:
    with pytest.raises(TraceError, match=r"no row arrives in the window \[500, 600\) s"):
        read_trace_file(fixture("burstgpt.csv"), selection=TraceSelection(window_s=(500, 600)))
    with pytest.raises(TraceError, match=r"every row in the window is skipped \(zero_resp"):
        read_trace_file(fixture("burstgpt.csv"), selection=TraceSelection(window_s=(40.5, 50)))


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"time_scale": 0.0}, "time_scale must be"),
        ({"time_scale": float("nan")}, "time_scale must be"),
        ({"window_s": (5.0, 5.0)}, "window_s must be"),
        ({"window_s": (-1.0, 5.0)}, "window_s must be"),
        ({"limit": 0}, "limit must be >= 1"),
    ],
)
def test_a_selection_out_of_range_is_refused(bad: dict[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        TraceSelection(**bad)  # type: ignore[arg-type]


def test_unsorted_rows_sort_stably() -> None:
    text = (
        "Timestamp,Request tokens,Response tokens\n"
        "9,1,1\n"  # id 0
        "3,2,1\n"  # id 1
        "9,3,1\n"  # id 2, the same time as id 0: after it
        "3,4,1\n"  # id 3
    )
    read = parse_trace_lines(io.StringIO(text), "u.csv")
    assert shape(read.requests) == [
        (1, 0.0, 2, 1),
        (3, 0.0, 4, 1),
        (0, 6000.0, 1, 1),
        (2, 6000.0, 3, 1),
    ]


# --- the CLI, as a subprocess --------------------------------------------------------------------


def simulate(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return run_command("simulate", *argv, stdin=stdin)


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@needs_scheduler
def test_cli_reads_an_azure_trace_and_describes_it() -> None:
    trace = fixture("azure_2023.csv")
    done = simulate("--trace", str(trace), "--kv-tokens", "8192", "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        f"helix-kv simulate: note: trace {trace}: skipped 2 of its 6 rows (1 "
        "zero_response_tokens, 1 zero_prompt_tokens)\n"
    )
    report = json.loads(done.stdout)
    assert report["config"]["workload"] == {
        "source": "trace",
        "path": str(trace),
        "format": "azure",
        "requests": 4,
        "arrivals": "ms",
        "rows": 6,
        "skipped": {"zero_response_tokens": 1, "zero_prompt_tokens": 1},
    }
    assert report["requests_finished"] == 4
    assert report["generated_tokens"] == 44 + 109 + 12 + 5


@needs_scheduler
def test_cli_window_limit_and_time_scale_are_in_the_report() -> None:
    trace = fixture("burstgpt.csv")
    done = simulate(
        "--trace", str(trace), "--trace-format", "burstgpt", "--time-scale", "0.25",
        "--trace-window", "0,100", "--trace-limit", "1", "--kv-tokens", "8192", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # nothing skipped before the first request
    workload_info = json.loads(done.stdout)["config"]["workload"]
    assert workload_info == {
        "source": "trace",
        "path": str(trace),
        "format": "burstgpt",
        "requests": 1,
        "arrivals": "ms",
        "rows": 6,
        "skipped": {},
        "time_scale": 0.25,
        "window_s": [0.0, 100.0],
        "limit": 1,
    }
    assert json.loads(done.stdout)["generated_tokens"] == 18


@needs_scheduler
def test_cli_mooncake_hash_ids_reach_the_prefix_cache() -> None:
    done = simulate(
        "--trace", str(fixture("mooncake.jsonl")), "--prefix-caching", "--kv-tokens", "16384",
        "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["config"]["workload"]["requests_with_content"] == 4
    assert report["config"]["workload"]["hash_block_tokens"] == 512
    assert report["outputs_exact"] is True


@needs_scheduler
@pytest.mark.parametrize("name", ["azure_2024.csv", "burstgpt.csv", "mooncake.jsonl"])
def test_cli_reads_every_format_from_stdin(name: str) -> None:
    text = fixture(name).read_text(encoding="utf-8")
    done = simulate("--trace", "-", "--kv-tokens", "16384", "--json", stdin=text)
    assert done.returncode == 0, done.stderr
    workload_info = json.loads(done.stdout)["config"]["workload"]
    assert workload_info["path"] == "<stdin>"
    assert workload_info["format"] == read_trace_file(fixture(name)).trace_format.value
    assert workload_info["requests"] == len(read_trace_file(fixture(name)).requests)


def test_cli_a_bad_row_on_stdin_is_one_line_naming_it() -> None:
    text = fixture("azure_negative_tokens.csv").read_text(encoding="utf-8")
    line = one_error_line(simulate("--trace", "-", stdin=text))
    assert line == (
        "helix-kv simulate: error: trace <stdin> line 4: 'ContextTokens' must be a whole number "
        'of tokens >= 0, got "-5" (format azure, detected from line 1)'
    )


def test_cli_a_forced_format_that_does_not_fit_is_a_usage_error() -> None:
    trace = fixture("mooncake.jsonl")
    line = one_error_line(simulate("--trace", str(trace), "--trace-format", "burstgpt"))
    assert line.startswith(f"helix-kv simulate: error: trace {trace} line 1: the header lacks")
    assert line.endswith("(format burstgpt, as given)")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--time-scale", "2"], "--time-scale reads a --trace; give --trace"),
        (["--trace-format", "azure"], "--trace-format reads a --trace; give --trace"),
        (["--trace-limit", "3"], "--trace-limit reads a --trace; give --trace"),
        (["--trace", "t", "--time-scale", "0"], "--time-scale: must be a number in (0, 1e+06]"),
        (["--trace", "t", "--trace-window", "5"], "--trace-window: expected START,END"),
        (["--trace", "t", "--trace-window", "5,5"], "--trace-window: END must be after START"),
        (["--trace", "t", "--trace-limit", "0"], "--trace-limit: must be >= 1"),
        (["--trace", "t", "--trace-format", "csv"], "--trace-format: invalid choice: 'csv'"),
    ],
)
def test_cli_trace_flag_errors(argv: list[str], message: str) -> None:
    assert message in one_error_line(simulate(*argv))


def test_cli_a_time_scale_on_a_trace_of_steps_is_refused(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": 0, "arrival_step": 0, "prompt_len": 5, "output_len": 1}\n')
    line = one_error_line(simulate("--trace", str(trace), "--trace-window", "0,5"))
    assert line == (
        f"helix-kv simulate: error: trace {trace}: its requests arrive at steps, not times: a "
        "time scale or window does not apply"
    )


# --- timed runs ------------------------------------------------------------------------------


@needs_scheduler
def test_cli_a_timed_trace_starts_each_request_after_its_arrival(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    trace = fixture("mooncake.jsonl")
    done = simulate(
        "--trace", str(trace), "--time-scale", "0.5", "--kv-tokens", "16384",
        "--events", str(events), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    arrived = {r.request_id: r.arrival_ms for r in read_trace_file(trace).requests}
    records = [json.loads(line) for line in events.read_text().splitlines()]
    finished = [record for record in records if record["type"] == "request"]
    assert len(finished) == 4
    for record in finished:  # halved: 0, 5267.5, 13741, 15500 ms
        assert record["first_token_ms"] >= arrived[record["request_id"]] * 0.5


def test_cli_a_run_that_cannot_start_has_its_error_alone_not_the_skipped_note() -> None:
    trace = fixture("azure_2023.csv")  # skips 2 rows; a 418-token request needs a bigger pool
    line = one_error_line(simulate("--trace", str(trace), "--kv-tokens", "256"))
    assert line.startswith("helix-kv simulate: error: ")
    assert "note" not in line
