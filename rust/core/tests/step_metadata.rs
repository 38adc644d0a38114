//! Packed step metadata against the calls it replaces: over random runs under KV pressure,
//! one scheduler per rank, every section written by `write_last_step_metadata` equals what
//! `block_table`, `slot_mapping`, the output and the layout give; refused calls leave the
//! buffer as it was.

mod common;

use common::{config, observable, prompt, Rng};
use helix_kv_core::{decode_row, CoreError, ScheduleOutput, Scheduler, StepMetadataLayout};

const SENTINEL: i32 = -7777;

/// The section named `name` of `buffer`, as (words, int64?).
fn section<'a>(layout: &StepMetadataLayout, buffer: &'a [i32], name: &str) -> (&'a [i32], bool) {
    let s = layout.sections().iter().find(|s| s.name == name).unwrap();
    let words = if s.int64 { 2 * s.len } else { s.len };
    (&buffer[s.offset_words..s.offset_words + words], s.int64)
}

fn int64s(words: &[i32]) -> Vec<i64> {
    words
        .chunks_exact(2)
        .map(|w| {
            let (low, high) = (w[0].to_ne_bytes(), w[1].to_ne_bytes());
            i64::from_ne_bytes([
                low[0], low[1], low[2], low[3], high[0], high[1], high[2], high[3],
            ])
        })
        .collect()
}

fn to_i32(values: impl IntoIterator<Item = u64>) -> Vec<i32> {
    values
        .into_iter()
        .map(|v| i32::try_from(v).unwrap())
        .collect()
}

/// Each section's written front, from the calls the packed buffer replaces.
fn expected_sections(
    s: &Scheduler,
    out: &ScheduleOutput,
    layout: &StepMetadataLayout,
) -> [(&'static str, Vec<i64>); 9] {
    let g = out.generation_ids.len();
    let ids: Vec<u64> = out
        .generation_ids
        .iter()
        .chain(&out.context_ids)
        .copied()
        .collect();
    let starts: Vec<u64> = out
        .generation_positions
        .iter()
        .chain(&out.context_starts)
        .copied()
        .collect();
    let counts: Vec<u64> = std::iter::repeat_n(1, g)
        .chain(out.context_lens.iter().copied())
        .collect();
    let layout_of = s.layout();
    let rank = s.config().cp_rank;
    let (table, width) = s.block_table(&ids, Some(layout.table_width())).unwrap();
    assert_eq!(width, layout.table_width());
    let slots = s.slot_mapping(&ids, &starts, &counts).unwrap();
    let positions: Vec<u64> = starts
        .iter()
        .zip(&counts)
        .flat_map(|(&start, &count)| start..start + count)
        .collect();
    let mut query_start = vec![0u64];
    for &count in &counts {
        query_start.push(query_start.last().unwrap() + count);
    }
    let ctx_local = out
        .context_starts
        .iter()
        .zip(&out.context_lens)
        .map(|(&start, &len)| layout_of.local_len(start + len, rank));
    let ctx_past = out
        .context_starts
        .iter()
        .map(|&start| layout_of.local_len(start, rank));
    let mut samples: Vec<u64> = (0..g as u64).collect();
    let mut end = g as u64;
    for (&len, &completes) in out.context_lens.iter().zip(&out.context_completes) {
        end += len;
        if completes {
            samples.push(end - 1);
        }
    }
    let tokens: Vec<i32> = out
        .generation_input_tokens
        .iter()
        .chain(&out.context_token_ids)
        .copied()
        .collect();
    let slots_in: Vec<i32> = out
        .generation_batch_slots
        .iter()
        .chain(&out.context_batch_slots)
        .copied()
        .collect();
    [
        ("token_ids", tokens.iter().map(|&t| i64::from(t)).collect()),
        ("positions", to_i64(positions)),
        ("slot_mapping", slots),
        ("query_start", to_i64(query_start)),
        (
            "local_lens",
            to_i64(out.generation_local_lens().chain(ctx_local)),
        ),
        (
            "past_seen_lens",
            to_i64(out.generation_past_seen_lens().chain(ctx_past)),
        ),
        (
            "batch_slots",
            slots_in.iter().map(|&v| i64::from(v)).collect(),
        ),
        ("sample_rows", to_i64(samples)),
        ("block_table", table.iter().map(|&v| i64::from(v)).collect()),
    ]
}

/// Checks every section of one written step against the separate calls.
fn check(s: &Scheduler, out: &ScheduleOutput, layout: &StepMetadataLayout) {
    check_source(s, out, layout, false);
}

/// [`check`], written from `out` itself (`from_out`; else from the output the scheduler
/// holds, which `out` is then a copy of).
fn check_source(s: &Scheduler, out: &ScheduleOutput, layout: &StepMetadataLayout, from_out: bool) {
    let mut buffer = vec![SENTINEL; layout.total_words()];
    let meta = if from_out {
        s.write_step_metadata(out.into(), layout, &mut buffer)
    } else {
        s.write_last_step_metadata(layout, &mut buffer)
    }
    .unwrap();
    let g = out.generation_ids.len();
    let entries = g + out.context_ids.len();
    let n = g + out.context_token_ids.len();
    assert_eq!((meta.num_tokens, meta.num_entries), (n, entries));
    for (name, want) in expected_sections(s, out, layout) {
        let (words, int64) = section(layout, &buffer, name);
        let got: Vec<i64> = if int64 {
            int64s(words)
        } else {
            words.iter().map(|&w| i64::from(w)).collect()
        };
        assert_eq!(&got[..want.len()], &want[..], "{name}");
        let rest = if int64 {
            &words[2 * want.len()..]
        } else {
            &words[want.len()..]
        };
        assert!(
            rest.iter().all(|&w| w == SENTINEL),
            "{name} written past its end"
        );
    }
    let header = section(layout, &buffer, "header").0;
    assert_eq!(int64s(&header[..2]), vec![i64::try_from(out.step).unwrap()]);
    assert_eq!(
        header[2..7].to_vec(),
        to_i32([
            n as u64,
            entries as u64,
            g as u64,
            out.num_samples() as u64,
            meta.table_width_used as u64
        ])
    );
}

fn to_i64(values: impl IntoIterator<Item = u64>) -> Vec<i64> {
    values
        .into_iter()
        .map(|v| i64::try_from(v).unwrap())
        .collect()
}

/// Feeds every rank the step's tokens and takes the outputs of the requests that finished.
fn update_every_rank(ranks: &mut [Scheduler], tokens: &[i32]) {
    for s in ranks {
        let finished = s.update(tokens, None).unwrap().to_vec();
        for id in finished {
            s.take_output(id).unwrap();
        }
    }
}

#[test]
fn packed_sections_equal_the_separate_calls_under_pressure() {
    for cp in [1u32, 2, 4] {
        for seed in 0..3u64 {
            let mut rng = Rng::new(seed * 10 + u64::from(cp));
            let tpb = u32::try_from(rng.range(2, 4)).unwrap();
            let superblocks = u32::try_from(rng.range(6, 12)).unwrap();
            let mut base = config(cp, tpb, superblocks);
            base.max_batch_size = 8;
            base.max_num_tokens = u32::try_from(rng.range(16, 40)).unwrap();
            base.max_seq_len = 100;
            base.chunk_unit = Some(tpb);
            let longest = 100.min(u64::from(superblocks * cp * tpb));
            let mut ranks: Vec<Scheduler> = (0..cp)
                .map(|r| {
                    let mut c = base.clone();
                    c.cp_rank = r;
                    Scheduler::new(c).unwrap()
                })
                .collect();
            let layout = ranks[0].step_metadata_layout(None).unwrap();
            let (mut next_id, mut pressured) = (0u64, 0);
            for _ in 0..50 {
                for _ in 0..rng.below(3) {
                    let len = rng.range(1, longest / 2);
                    let max_new = u32::try_from(rng.range(1, longest - len)).unwrap();
                    for s in &mut ranks {
                        s.add_request(next_id, &prompt(usize::try_from(len).unwrap()), max_new, 0)
                            .unwrap();
                    }
                    next_id += 1;
                }
                let outs: Vec<ScheduleOutput> = ranks
                    .iter_mut()
                    .map(|s| s.schedule().unwrap().clone())
                    .collect();
                pressured += usize::from(!outs[0].preempted_ids.is_empty());
                for (s, out) in ranks.iter().zip(&outs) {
                    check(s, out, &layout);
                }
                let tokens: Vec<i32> = (0..outs[0].num_samples())
                    .map(|_| i32::try_from(rng.below(1000)).unwrap())
                    .collect();
                update_every_rank(&mut ranks, &tokens);
            }
            assert!(pressured > 0, "cp {cp} seed {seed}: no preemption");
        }
    }
}

#[test]
fn refused_calls_leave_the_buffer_as_it_was() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    for id in 0..3 {
        s.add_request(id, &prompt(9), 5, 0).unwrap();
    }
    let layout = s.step_metadata_layout(None).unwrap();
    let mut buffer = vec![SENTINEL; layout.total_words()];
    // No pending step yet.
    let err = s
        .write_last_step_metadata(&layout, &mut buffer)
        .unwrap_err();
    assert!(matches!(err, CoreError::InvalidState(_)), "{err}");
    s.schedule().unwrap();
    let too_small = [
        StepMetadataLayout::new(26, 8, u32::try_from(layout.table_width()).unwrap()).unwrap(), // 27 tokens
        StepMetadataLayout::new(64, 2, u32::try_from(layout.table_width()).unwrap()).unwrap(), // 3 entries
        StepMetadataLayout::new(64, 8, 1).unwrap(), // 2-wide tables
    ];
    for small in &too_small {
        let mut words = vec![SENTINEL; small.total_words()];
        let err = s.write_last_step_metadata(small, &mut words).unwrap_err();
        assert!(matches!(err, CoreError::InvalidLength(_)), "{err}");
        assert!(words.iter().all(|&w| w == SENTINEL));
    }
    let mut short = vec![SENTINEL; layout.total_words() - 1];
    let err = s.write_last_step_metadata(&layout, &mut short).unwrap_err();
    assert!(matches!(err, CoreError::InvalidLength(_)), "{err}");
    assert!(short.iter().all(|&w| w == SENTINEL));
    // A forged output naming a request the ledger does not hold.
    let mut forged = s.last_output().clone();
    forged.context_ids[2] = 99;
    let err = s
        .write_step_metadata((&forged).into(), &layout, &mut buffer)
        .unwrap_err();
    assert_eq!(err, CoreError::UnknownRequest(99));
    assert!(buffer.iter().all(|&w| w == SENTINEL));
    // Another scheduler's output of the same step number (other prompts: another digest).
    let mut other = Scheduler::new(config(2, 4, 16)).unwrap();
    for id in 0..3 {
        let mut tokens = prompt(9);
        tokens[0] += 1;
        other.add_request(id, &tokens, 5, 0).unwrap();
    }
    let theirs = other.schedule().unwrap().clone();
    assert_eq!(theirs.step, s.last_output().step);
    assert_ne!(theirs.digest, s.last_output().digest);
    let err = s
        .write_step_metadata((&theirs).into(), &layout, &mut buffer)
        .unwrap_err();
    assert!(matches!(err, CoreError::InvalidState(_)), "{err}");
    assert!(buffer.iter().all(|&w| w == SENTINEL));
    s.write_last_step_metadata(&layout, &mut buffer).unwrap();
}

/// Checks the decode rows of one step against the separate calls, or (a step with context
/// chunks) that they are refused with the buffer as it was. Returns whether rows were
/// written and how many inputs were in flight.
fn check_rows(s: &Scheduler, out: &ScheduleOutput, columns: usize) -> Option<usize> {
    check_rows_source(s, out, columns, false)
}

/// [`check_rows`], written from `out` itself (`from_out`; else from the output the
/// scheduler holds, which `out` is then a copy of).
fn check_rows_source(
    s: &Scheduler,
    out: &ScheduleOutput,
    columns: usize,
    from_out: bool,
) -> Option<usize> {
    let write = |buffer: &mut [i32], width: usize, pad_to: usize| {
        if from_out {
            s.write_decode_rows(out.into(), buffer, width, pad_to)
        } else {
            s.write_last_decode_rows(buffer, width, pad_to)
        }
    };
    let width = decode_row::BLOCK_TABLE + columns;
    let capacity = 8;
    let mut buffer = vec![SENTINEL; capacity * width];
    let g = out.generation_ids.len();
    let pad_to = (g + 2).min(capacity);
    if !out.context_ids.is_empty() {
        let err = write(&mut buffer, width, pad_to).unwrap_err();
        assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
        assert!(buffer.iter().all(|&w| w == SENTINEL));
        return None;
    }
    let counts = write(&mut buffer, width, pad_to).unwrap();
    assert_eq!((counts.rows, counts.padded_to), (g, pad_to.max(g)));
    let ones = vec![1u64; g];
    let (table, table_width) = s.block_table(&out.generation_ids, Some(columns)).unwrap();
    assert_eq!(table_width, columns);
    let slots = s
        .slot_mapping(&out.generation_ids, &out.generation_positions, &ones)
        .unwrap();
    let local: Vec<u64> = out.generation_local_lens().collect();
    let past: Vec<u64> = out.generation_past_seen_lens().collect();
    for (i, row) in buffer.chunks_exact(width).enumerate() {
        if i < g {
            let mut want = [0i32; decode_row::BLOCK_TABLE];
            want[decode_row::TOKEN_ID] = out.generation_input_tokens[i];
            want[decode_row::POSITION] = i32::try_from(out.generation_positions[i]).unwrap();
            want[decode_row::SLOT] = i32::try_from(slots[i]).unwrap();
            want[decode_row::LOCAL_LEN] = i32::try_from(local[i]).unwrap();
            want[decode_row::PAST_SEEN_LEN] = i32::try_from(past[i]).unwrap();
            want[decode_row::INPUT_REF] = out.generation_input_refs[i];
            assert_eq!(row[..decode_row::BLOCK_TABLE], want, "row {i}");
            assert_eq!(
                row[decode_row::BLOCK_TABLE..],
                table[i * columns..(i + 1) * columns],
                "row {i}"
            );
        } else if i < counts.padded_to {
            assert_eq!(row[..decode_row::BLOCK_TABLE], decode_row::PADDING);
            assert!(row[decode_row::BLOCK_TABLE..]
                .iter()
                .all(|&w| w == SENTINEL));
        } else {
            assert!(row.iter().all(|&w| w == SENTINEL), "row {i} written");
        }
    }
    let in_flight = out
        .generation_input_refs
        .iter()
        .filter(|&&r| r >= 0)
        .count();
    assert_eq!(counts.in_flight, in_flight);
    Some(in_flight)
}

#[test]
fn decode_rows_equal_the_separate_calls_under_pressure_plain_and_one_step_ahead() {
    for ahead in [false, true] {
        for cp in [1u32, 2, 4] {
            let (mut decode_steps, mut in_flight, mut pressured) = (0, 0, 0);
            for seed in 0..3u64 {
                let mut rng = Rng::new(seed * 10 + u64::from(cp) + 100);
                let tpb = u32::try_from(rng.range(2, 4)).unwrap();
                let superblocks = u32::try_from(rng.range(6, 12)).unwrap();
                let mut base = config(cp, tpb, superblocks);
                base.max_batch_size = 8;
                base.max_num_tokens = u32::try_from(rng.range(16, 40)).unwrap();
                base.max_seq_len = 100;
                base.chunk_unit = Some(tpb);
                let longest = 100.min(u64::from(superblocks * cp * tpb));
                let mut ranks: Vec<Scheduler> = (0..cp)
                    .map(|r| {
                        let mut c = base.clone();
                        c.cp_rank = r;
                        Scheduler::new(c).unwrap()
                    })
                    .collect();
                let columns = ranks[0].step_metadata_layout(None).unwrap().table_width();
                let mut next_id = 0u64;
                let mut pending: Option<ScheduleOutput> = None;
                for round in 0..60 {
                    if round % 4 == 0 {
                        for _ in 0..rng.below(3) {
                            let len = rng.range(1, longest / 2);
                            let max_new = u32::try_from(rng.range(1, longest - len)).unwrap();
                            for s in &mut ranks {
                                let p = prompt(usize::try_from(len).unwrap());
                                s.add_request(next_id, &p, max_new, 0).unwrap();
                            }
                            next_id += 1;
                        }
                    }
                    if !ranks[0].has_unfinished() && pending.is_none() {
                        continue;
                    }
                    let out = if ranks[0].has_unfinished() {
                        let outs: Vec<ScheduleOutput> = ranks
                            .iter_mut()
                            .map(|s| s.schedule().unwrap().clone())
                            .collect();
                        pressured += usize::from(!outs[0].preempted_ids.is_empty());
                        for (s, out) in ranks.iter().zip(&outs) {
                            if let Some(n) = check_rows(s, out, columns) {
                                decode_steps += 1;
                                in_flight += n;
                            }
                        }
                        Some(outs[0].clone())
                    } else {
                        None
                    };
                    // Plain: close the step now; one step ahead: close the older one.
                    let closing = if ahead {
                        std::mem::replace(&mut pending, out)
                    } else {
                        out
                    };
                    if let Some(closing) = closing {
                        let tokens: Vec<i32> = (0..closing.num_samples())
                            .map(|_| i32::try_from(rng.below(1000)).unwrap())
                            .collect();
                        update_every_rank(&mut ranks, &tokens);
                    }
                }
            }
            assert!(decode_steps > 0, "cp {cp}: no decode-only step");
            assert!(pressured > 0, "cp {cp}: no preemption");
            assert_eq!(in_flight > 0, ahead, "cp {cp}: inputs in flight");
        }
    }
}

/// `out` with its generation entries in reverse order: each row's hint (the scheduler's
/// index of the request of that row) then misses, so the requests are looked up.
fn reversed(out: &ScheduleOutput) -> ScheduleOutput {
    let mut r = out.clone();
    r.generation_ids.reverse();
    r.generation_positions.reverse();
    r.generation_input_tokens.reverse();
    r.generation_input_refs.reverse();
    r.generation_batch_slots.reverse();
    r
}

#[test]
fn steps_whose_hints_miss_are_written_through_lookups_alike() {
    for cp in [1u32, 2, 4] {
        for tpb in [2u32, 3] {
            let mut base = config(cp, tpb, 200);
            base.max_batch_size = 8;
            base.max_num_tokens = 32;
            base.max_seq_len = 100;
            let mut ranks: Vec<Scheduler> = (0..cp)
                .map(|r| {
                    let mut c = base.clone();
                    c.cp_rank = r;
                    Scheduler::new(c).unwrap()
                })
                .collect();
            for s in &mut ranks {
                for id in 0..5u64 {
                    let len = 1 + usize::try_from(id * 7).unwrap();
                    s.add_request(id, &prompt(len), 30, 0).unwrap();
                }
            }
            let layout = ranks[0].step_metadata_layout(None).unwrap();
            let columns = layout.table_width();
            let mut reversed_steps = 0;
            for _ in 0..25 {
                let outs: Vec<ScheduleOutput> = ranks
                    .iter_mut()
                    .map(|s| s.schedule().unwrap().clone())
                    .collect();
                for (s, out) in ranks.iter().zip(&outs) {
                    if out.generation_ids.len() >= 2 {
                        let back = reversed(out);
                        check_source(s, &back, &layout, true);
                        check_rows_source(s, &back, columns, true);
                        reversed_steps += 1;
                    }
                }
                let tokens = vec![7; outs[0].num_samples()];
                update_every_rank(&mut ranks, &tokens);
            }
            assert!(reversed_steps > 0, "cp {cp} tpb {tpb}: no step reversed");
        }
    }
}

#[test]
fn a_refused_decode_step_names_its_first_failing_row() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    for id in 0..3 {
        s.add_request(id, &prompt(9), 5, 0).unwrap();
    }
    let prefill = s.schedule().unwrap().clone();
    s.update(&vec![7; prefill.num_samples()], None).unwrap();
    s.schedule().unwrap();
    let layout = s.step_metadata_layout(None).unwrap();
    let width = decode_row::BLOCK_TABLE + layout.table_width();
    let good = s.last_output().clone();
    // Row 0 past what it reserved and row 1 unknown: row 0 is named, whichever check
    // comes first in a row; row 1 alone: the unknown request.
    let mut both = good.clone();
    both.generation_positions[0] += 100;
    both.generation_ids[1] = 99;
    let mut second = good.clone();
    second.generation_ids[1] = 99;
    let mut wide = good.clone();
    wide.generation_positions[2] = u64::from(u32::MAX);
    for (out, unknown) in [(&both, false), (&second, true), (&wide, false)] {
        let mut rows = vec![SENTINEL; 8 * width];
        let err = s
            .write_decode_rows(out.into(), &mut rows, width, 0)
            .unwrap_err();
        let mut words = vec![SENTINEL; layout.total_words()];
        let packed_err = s
            .write_step_metadata(out.into(), &layout, &mut words)
            .unwrap_err();
        for err in [err, packed_err] {
            if unknown {
                assert_eq!(err, CoreError::UnknownRequest(99));
            } else {
                assert!(matches!(err, CoreError::InvalidLength(_)), "{err}");
            }
        }
        assert!(rows.iter().all(|&w| w == SENTINEL));
        assert!(words.iter().all(|&w| w == SENTINEL));
    }
}

#[test]
fn refused_decode_rows_leave_the_buffer_as_it_was() {
    let mut s = Scheduler::new(config(2, 4, 16)).unwrap();
    for id in 0..3 {
        s.add_request(id, &prompt(9), 5, 0).unwrap();
    }
    let width = decode_row::BLOCK_TABLE + 4;
    let mut buffer = vec![SENTINEL; 8 * width];
    let err = s.write_last_decode_rows(&mut buffer, width, 0).unwrap_err();
    assert!(matches!(err, CoreError::InvalidState(_)), "{err}");
    let prefill = s.schedule().unwrap().clone();
    // A step with context chunks.
    let err = s.write_last_decode_rows(&mut buffer, width, 0).unwrap_err();
    assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
    s.update(&vec![7; prefill.num_samples()], None).unwrap();
    s.schedule().unwrap();
    let before = observable(&s);
    let refusals: [(usize, usize, usize); 6] = [
        (2 * width, width, 0),                                     // 3 rows, 2 fit
        (8 * width, width, 9),                                     // padded past the buffer
        (8 * width - 1, width, 0),                                 // not whole rows
        (8 * 5, 5, 0),                                             // no room for the fixed columns
        (8 * decode_row::BLOCK_TABLE, decode_row::BLOCK_TABLE, 0), // no table column
        (8 * width, width, usize::MAX),                            // absurd padding
    ];
    for (words, w, pad_to) in refusals {
        let mut small = vec![SENTINEL; words];
        let err = s.write_last_decode_rows(&mut small, w, pad_to).unwrap_err();
        assert!(
            matches!(
                err,
                CoreError::InvalidLength(_) | CoreError::InvalidArgument(_)
            ),
            "{err}"
        );
        assert!(small.iter().all(|&w| w == SENTINEL));
    }
    // Forged outputs: an unknown request, an input reference below -1, a position past
    // what the request reserved, arrays of different lengths.
    let good = s.last_output().clone();
    let mut forged = [good.clone(), good.clone(), good.clone(), good.clone()];
    forged[0].generation_ids[1] = 99;
    forged[1].generation_input_refs[0] = -2;
    forged[2].generation_positions[2] += 100;
    forged[3].generation_input_refs.pop();
    let errors = [
        CoreError::UnknownRequest(99),
        CoreError::InvalidArgument(String::new()),
        CoreError::InvalidLength(String::new()),
        CoreError::InvalidArgument(String::new()),
    ];
    for (out, want) in forged.iter().zip(errors) {
        let err = s
            .write_decode_rows(out.into(), &mut buffer, width, 0)
            .unwrap_err();
        assert_eq!(
            std::mem::discriminant(&err),
            std::mem::discriminant(&want),
            "{err}"
        );
        assert!(buffer.iter().all(|&w| w == SENTINEL));
    }
    assert_eq!(observable(&s), before);
    let counts = s.write_last_decode_rows(&mut buffer, width, 0).unwrap();
    assert_eq!((counts.rows, counts.padded_to, counts.in_flight), (3, 3, 0));
}

#[test]
fn decode_row_columns_are_named_in_order() {
    let named = [
        (decode_row::TOKEN_ID, "token_id"),
        (decode_row::POSITION, "position"),
        (decode_row::SLOT, "slot"),
        (decode_row::LOCAL_LEN, "local_len"),
        (decode_row::PAST_SEEN_LEN, "past_seen_len"),
        (decode_row::INPUT_REF, "input_ref"),
    ];
    for (column, name) in named {
        assert_eq!(decode_row::NAMES[column], name);
    }
    assert_eq!(decode_row::NAMES.len(), decode_row::BLOCK_TABLE);
}
