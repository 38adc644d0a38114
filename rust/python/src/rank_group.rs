//! The calls an in-process CP group (`helix_kv.SimulatedCPGroup`) makes on every rank, in
//! one crossing each: `add_request_ranks`, `schedule_ranks` and `update_ranks` call every
//! rank's scheduler in turn, as its own `add_request()`, `schedule()` and `update()` would.
//! Each returns every rank's result, or the exception that rank raised; `schedule_ranks` and
//! `update_ranks` also compare the ranks' results here and say whether they agree, and the
//! group builds its detailed mismatch message from those results only when they do not, so
//! the message is the one it always built, and the check on every step costs no numpy array.
//!
//! Agreement is exactly what the group checks: every call succeeded, the digests are equal
//! (they cover every rank-invariant field) and, when the group's layout is given, the
//! per-rank fields are what the layout gives (see [`rank_fields_fit`]); for `update`, every
//! call succeeded with the same finished ids.

use helix_kv_core::Layout;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::arrays::{invalid_type_of, u64_vec};
use crate::errors::InvalidArgumentError;
use crate::layout::PyLayout;
use crate::schedule_output::PyScheduleOutput;
use crate::scheduler::{ids_to_numpy, update_args, NewRequest, Priority, PyScheduler};
use helix_kv_core::RankPlacement;

/// The schedulers of `schedulers` (a sequence), every one checked before any is called, so
/// a bad argument changes nothing.
fn schedulers_of<'py>(schedulers: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyScheduler>>> {
    schedulers
        .try_iter()?
        .map(|item| {
            let item = item?;
            item.cast_into::<PyScheduler>().map_err(|error| {
                invalid_type_of(
                    "schedulers",
                    "a sequence of Scheduler",
                    error.into_inner().as_any(),
                )
            })
        })
        .collect()
}

/// Adds a request to each of `schedulers` in turn (each as its `add_request()`): the
/// arguments are checked once, and the prompt's prefix-cache keys computed once for all of
/// them (they are a pure function of the tokens, the salt and the superblock size; see
/// `PreparedPrompt`). Returns each one's `None`, or the exception it raised, in order. An
/// argument every `add_request()` would refuse is raised here, before any is called.
#[pyfunction]
#[pyo3(
    signature = (schedulers, request_id, prompt, max_new_tokens, priority = Priority::default(), *, cache_salt = None),
    text_signature = "(schedulers, request_id, prompt, max_new_tokens, priority=0, *, cache_salt=None)"
)]
pub fn add_request_ranks<'py>(
    py: Python<'py>,
    schedulers: &Bound<'py, PyAny>,
    request_id: &Bound<'py, PyAny>,
    prompt: &Bound<'py, PyAny>,
    max_new_tokens: &Bound<'py, PyAny>,
    priority: Priority,
    cache_salt: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyList>> {
    let schedulers = schedulers_of(schedulers)?;
    let request = NewRequest::parse(request_id, prompt, max_new_tokens, priority, cache_salt)?;
    let results = PyList::empty(py);
    for scheduler in &schedulers {
        match scheduler.try_borrow_mut()?.add_new(&request) {
            Ok(()) => results.append(py.None())?,
            Err(error) => results.append(error.into_value(py))?,
        }
    }
    Ok(results)
}

/// Schedules a step on each of `schedulers` in turn (each as its `schedule()`). Returns each
/// one's output, or the exception it raised, in order, and whether they agree: every call
/// succeeded and the digests are equal, and, with `layout` (the group's) and `ranks` (each
/// scheduler's rank), the per-rank fields fit the layout, as `SimulatedCPGroup` checks them.
#[pyfunction]
#[pyo3(signature = (schedulers, layout, ranks))]
pub fn schedule_ranks<'py>(
    py: Python<'py>,
    schedulers: &Bound<'py, PyAny>,
    layout: Option<&Bound<'py, PyAny>>,
    ranks: &Bound<'py, PyAny>,
) -> PyResult<(Bound<'py, PyList>, bool)> {
    let ranks = u64_vec(ranks, "ranks", false)?
        .into_iter()
        .map(|rank| {
            u32::try_from(rank).map_err(|_| {
                InvalidArgumentError::new_err(format!("ranks must be in 0..=2**32-1, got {rank}"))
            })
        })
        .collect::<PyResult<Vec<u32>>>()?;
    let layout = layout
        .filter(|layout| !layout.is_none())
        .map(|layout| {
            let layout = layout
                .cast::<PyLayout>()
                .map_err(|_| invalid_type_of("layout", "a Layout or None", layout))?;
            Ok::<_, PyErr>(layout.get().inner)
        })
        .transpose()?;
    let schedulers = schedulers_of(schedulers)?;
    if layout.is_some() && ranks.len() != schedulers.len() {
        return Err(InvalidArgumentError::new_err(format!(
            "schedule_ranks: {} schedulers but {} ranks",
            schedulers.len(),
            ranks.len()
        )));
    }
    let results = PyList::empty(py);
    let mut outputs: Vec<Py<PyScheduleOutput>> = Vec::new();
    let mut all_ok = true;
    for scheduler in &schedulers {
        match scheduler.try_borrow_mut()?.schedule_step(py) {
            Ok(output) => {
                let output = Py::new(py, output)?;
                results.append(output.clone_ref(py))?;
                outputs.push(output);
            }
            Err(error) => {
                all_ok = false;
                results.append(error.into_value(py))?;
            }
        }
    }
    let outputs: Vec<&PyScheduleOutput> = outputs.iter().map(Py::get).collect();
    let agree = all_ok && schedules_agree(py, &outputs, layout, &ranks);
    Ok((results, agree))
}

/// Feeds the same sampled tokens (end-of-sequence flags, accepted draft counts; read once,
/// as each `update()` reads them) to each of `schedulers` in turn. Returns each one's
/// finished ids (uint64), or the exception it raised, in order, and whether they agree:
/// every call succeeded with the same ids.
#[pyfunction]
#[pyo3(signature = (schedulers, tokens, eos = None, accepted = None))]
pub fn update_ranks<'py>(
    py: Python<'py>,
    schedulers: &Bound<'py, PyAny>,
    tokens: &Bound<'py, PyAny>,
    eos: Option<&Bound<'py, PyAny>>,
    accepted: Option<&Bound<'py, PyAny>>,
) -> PyResult<(Bound<'py, PyList>, bool)> {
    let (tokens, eos, accepted) = update_args(tokens, eos, accepted)?;
    let tokens = tokens.as_slice()?;
    let eos = eos.as_ref().map(|eos| eos.as_slice()).transpose()?;
    let schedulers = schedulers_of(schedulers)?;
    let results = PyList::empty(py);
    let mut first: Option<Vec<u64>> = None;
    let mut agree = true;
    for scheduler in &schedulers {
        let finished =
            scheduler
                .try_borrow_mut()?
                .update_step(py, tokens, eos, accepted.as_deref());
        match finished {
            Ok(finished) => {
                match &first {
                    Some(first) => agree &= *first == finished,
                    None => first = Some(finished.clone()),
                }
                results.append(ids_to_numpy(py, finished))?;
            }
            Err(error) => {
                agree = false;
                results.append(error.into_value(py))?;
            }
        }
    }
    Ok((results, agree))
}

/// Whether one step's outputs agree: equal digests and, with `layout`, per-rank fields that
/// fit it.
fn schedules_agree(
    py: Python<'_>,
    outputs: &[&PyScheduleOutput],
    layout: Option<Layout>,
    ranks: &[u32],
) -> bool {
    let Some(first) = outputs.first() else {
        return true;
    };
    if outputs
        .iter()
        .any(|output| output.digest_value() != first.digest_value())
    {
        return false;
    }
    let Some(layout) = layout else {
        return true;
    };
    // Equal digests: every output has these positions.
    let positions = first.positions(py);
    let placements: Vec<RankPlacement> = outputs.iter().map(|o| o.unread_placement(py)).collect();
    rank_fields_fit(positions.as_slice(), &placements, layout, ranks)
}

/// The group's per-rank check (`SimulatedCPGroup._check_rank_fields`), exactly: the first
/// output's owner ranks are the layout's owners of its positions; then with every rank of
/// the layout here (`ranks` is `0..cp_size`), each decode is active on its owner alone, the
/// local lengths add up to position + 1 and the past-seen ones to the position, and only
/// the owner's length grows; with some ranks here, each one's fields are exactly the
/// layout's for that rank. No decode: nothing to check. Lengths that do not fit together
/// (or a rank outside the layout, or a position numpy cannot hold) do not fit either. Read
/// row by row: no column is copied.
fn rank_fields_fit(
    positions: &[u64],
    placements: &[RankPlacement],
    layout: Layout,
    ranks: &[u32],
) -> bool {
    let Some(reference) = placements.first() else {
        return true;
    };
    if positions.is_empty() {
        return true;
    }
    // Python reads positions as int64.
    if positions.iter().any(|&p| i64::try_from(p).is_err())
        || positions
            .iter()
            .any(|&p| reference.decode_at(p).owner != layout.owner_rank(p))
    {
        return false;
    }
    if placements.len() != ranks.len() || ranks.iter().any(|&rank| rank >= layout.cp()) {
        return false;
    }
    if ranks.len() == layout.cp() as usize {
        return positions.iter().all(|&p| {
            let owner = layout.owner_rank(p) as usize;
            let (mut local_sum, mut past_sum) = (0u128, 0u128);
            for (index, placement) in placements.iter().enumerate() {
                let placed = placement.decode_at(p);
                let owns = owner == index;
                let active = placed.owner == placement.cp_rank();
                if active != owns
                    || i128::from(placed.local_len) - i128::from(placed.past_seen_len)
                        != i128::from(owns)
                {
                    return false;
                }
                local_sum += u128::from(placed.local_len);
                past_sum += u128::from(placed.past_seen_len);
            }
            local_sum == u128::from(p) + 1 && past_sum == u128::from(p)
        });
    }
    placements.iter().zip(ranks).all(|(placement, &rank)| {
        positions.iter().all(|&p| {
            let placed = placement.decode_at(p);
            (placed.owner == placement.cp_rank()) == (layout.owner_rank(p) == rank)
                && placed.local_len == layout.local_len(p + 1, rank)
                && placed.past_seen_len == layout.local_len(p, rank)
        })
    })
}
