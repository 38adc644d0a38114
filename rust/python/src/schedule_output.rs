//! `ScheduleOutput`: one step's schedule as numpy arrays. The core's vectors are moved in
//! (no copy) and each becomes a read-only numpy array, also without a copy, the first time
//! Python reads it; fields never read cost nothing. The arrays cannot be written, so what
//! `summary()` and `differing_fields()` read is always what `digest` fingerprints.
//!
//! The class, its getters, the conversions both ways and its field lists are built from the
//! core's one field list (`helix_kv_core::schedule_output_fields!`).
//!
//! The owner ranks (`generation_owner_ranks`, the same on every rank) and this rank's share of
//! the decodes (`PER_RANK_FIELDS`: `generation_active`, `generation_local_lens`,
//! `generation_past_seen_lens`) are not stored by the core (`COMPUTED_FIELDS`): the output
//! carries the rank's placement (`cp_rank`, `cp_size`, `tokens_per_block`) and each of those
//! arrays is computed from `generation_positions` the first time Python reads it, then cached
//! (read-only like the others). Nor is `sample_ids` (the generation ids, then the completing
//! context ids), computed from those fields the same way; `num_samples` counts it without
//! making it. A step whose computed arrays are never read never computes them. Pickles carry
//! the placement, not those arrays.

use std::sync::{Arc, Mutex, PoisonError};

use helix_kv_core::{FieldScope, Layout, RankPlacement, RequestId, ScheduleOutput};
use numpy::{Element, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::arrays::{int_arg, invalid_type_of, make_read_only, readable, u64_arg};
use crate::errors::{IntoPyResult, InvalidArgumentError, InvalidLengthError};
use crate::layout::rank_int32;

/// A core element type exposed as numpy dtype `N` (ids as uint64, lengths and positions
/// as int64, ranks as int32), with the exact conversions both ways.
pub trait Exposed<N: Element + Copy>: Sized + Copy + Send + Clone {
    /// Whether a value out of range is an `InvalidLengthError` (a length, position or
    /// count) rather than an `InvalidArgumentError`, as for every argument.
    const LENGTH: bool = false;
    fn to_numpy(self) -> N;
    /// `None` where `value` does not fit (a negative length or rank: only `_from_fields`
    /// reads arrays the binding did not make).
    fn from_numpy(value: N) -> Option<Self>;
}

/// Types numpy holds as they are, with nothing to convert either way: request ids (the
/// whole `u64` range) as uint64; batch slots, token and block ids as int32; flags as bool.
macro_rules! exposed_as_they_are {
    ($($ty:ty),* $(,)?) => {$(
        impl Exposed<$ty> for $ty {
            fn to_numpy(self) -> $ty {
                self
            }
            fn from_numpy(value: $ty) -> Option<Self> {
                Some(value)
            }
        }
    )*};
}

exposed_as_they_are!(u64, i32, bool);

/// Lengths, positions and counts, as int64.
impl Exposed<i64> for u64 {
    const LENGTH: bool = true;
    #[expect(
        clippy::cast_possible_wrap,
        reason = "a schedule's lengths, positions and counts lie within the ledger's pool (at most \
                  i32::MAX superblocks of at most 2**24 tokens: below 2**55), or came from int64 \
                  (`_from_fields`)"
    )]
    fn to_numpy(self) -> i64 {
        debug_assert!(i64::try_from(self).is_ok());
        self as i64
    }
    fn from_numpy(value: i64) -> Option<Self> {
        u64::try_from(value).ok()
    }
}

/// Owner ranks (the computed `generation_owner_ranks`), as int32.
impl Exposed<i32> for u32 {
    fn to_numpy(self) -> i32 {
        rank_int32(self)
    }
    fn from_numpy(value: i32) -> Option<Self> {
        u32::try_from(value).ok()
    }
}

/// One output array: the core's vector until Python first reads it, then a cached read-only
/// numpy array that owns the same buffer (same-size element conversions reuse the
/// allocation).
pub struct LazyArray<T: Exposed<N>, N: Element + Copy> {
    vector: Mutex<Option<Vec<T>>>,
    array: PyOnceLock<Py<PyArray1<N>>>,
}

impl<T: Exposed<N>, N: Element + Copy> LazyArray<T, N> {
    fn new(vector: Vec<T>) -> Self {
        Self {
            vector: Mutex::new(Some(vector)),
            array: PyOnceLock::new(),
        }
    }

    /// The values of a 1-D numpy array of dtype `N` (copied: the caller keeps its array;
    /// a strided or misaligned one is read through a contiguous copy); a value out of the
    /// field's range is refused, as for every argument.
    fn from_object(value: &Bound<'_, PyAny>, field: &str) -> PyResult<Self> {
        let array = value
            .cast::<PyArray1<N>>()
            .map_err(|_| invalid_type_of(field, "a 1-D numpy array of the field's dtype", value))?;
        let array = readable::<N>(array.as_untyped())?;
        let values = array.as_slice()?.iter().enumerate().map(|(i, &v)| {
            T::from_numpy(v).ok_or_else(|| {
                let message = format!("ScheduleOutput field {field}[{i}] must be non-negative");
                if T::LENGTH {
                    InvalidLengthError::new_err(message)
                } else {
                    InvalidArgumentError::new_err(message)
                }
            })
        });
        Ok(Self::new(values.collect::<PyResult<_>>()?))
    }

    /// The vector, if Python never read the array (else empty), for reuse; `&mut`, so no
    /// lock is taken.
    fn take_unread(&mut self) -> Vec<T> {
        self.vector
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .unwrap_or_default()
    }

    fn take_vector(&self) -> Vec<T> {
        self.vector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .unwrap_or_default()
    }

    /// The numpy array (created on first use, read-only).
    pub fn get<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<N>> {
        self.array
            .get_or_init(py, || {
                let converted: Vec<N> = self.take_vector().into_iter().map(T::to_numpy).collect();
                let array = PyArray1::from_vec(py, converted);
                make_read_only(&array);
                array.unbind()
            })
            .bind(py)
            .clone()
    }

    /// The values, wherever they live now.
    fn values(&self, py: Python<'_>) -> Vec<T> {
        if let Some(array) = self.array.get(py) {
            // The binding's own read-only array of `to_numpy` values: every one converts back.
            return array
                .bind(py)
                .to_vec()
                .unwrap_or_default()
                .into_iter()
                .map(T::from_numpy)
                .collect::<Option<_>>()
                .unwrap_or_default();
        }
        self.vector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .unwrap_or_default()
    }

    /// Number of values, without creating the array.
    fn len(&self, py: Python<'_>) -> usize {
        if let Some(array) = self.array.get(py) {
            return PyUntypedArrayMethods::len(array.bind(py));
        }
        self.vector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
            .map_or(0, Vec::len)
    }
}

/// What the `get_all` getters return for an array field: the cached numpy array.
impl<'py, T: Exposed<N>, N: Element + Copy> IntoPyObject<'py> for &LazyArray<T, N> {
    type Target = PyArray1<N>;
    type Output = Bound<'py, PyArray1<N>>;
    type Error = std::convert::Infallible;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        Ok(self.get(py))
    }
}

/// The numpy dtype of a core element type.
macro_rules! exposed {
    (RequestId) => {
        u64
    };
    (u64) => {
        i64
    };
    (u32) => {
        i32
    };
    (i32) => {
        i32
    };
    (bool) => {
        bool
    };
}

/// The binding's type for a field: a [`LazyArray`] for an array, the value for a scalar.
macro_rules! py_field_type {
    ([$element:tt]) => { LazyArray<$element, exposed!($element)> };
    ($scalar:ty) => { $scalar };
}

/// One field of the core output in the binding's form.
macro_rules! from_core_field {
    ($value:expr, [$element:tt]) => {
        LazyArray::new($value)
    };
    ($value:expr, $scalar:ty) => {
        $value
    };
}

/// One field of the binding's output in the core's form (the arrays as they are now).
macro_rules! to_core_field {
    ($field:expr, $py:expr, [$element:tt]) => {
        $field.values($py)
    };
    ($field:expr, $py:expr, $scalar:ty) => {
        $field
    };
}

/// One field as a Python object (`__reduce__`): the numpy array, or the int.
macro_rules! field_object {
    ($field:expr, $py:expr, [$element:tt]) => {
        $field.get($py).into_any()
    };
    ($field:expr, $py:expr, $scalar:ty) => {
        $field.into_pyobject($py)?.into_any()
    };
}

/// One field rebuilt from a Python object (`_from_fields`).
macro_rules! field_from_object {
    ($value:expr, $name:expr, [$element:tt]) => {
        LazyArray::from_object($value, $name)?
    };
    ($value:expr, $name:expr, $scalar:ty) => {
        u64_arg($value, $name)?
    };
}

/// One field's buffer for the spare slot: an array's vector if Python never read it (a
/// read one lives in its numpy array now), nothing for a scalar.
macro_rules! spare_field {
    ($field:expr, [$element:tt]) => {
        $field.take_unread()
    };
    ($field:expr, $scalar:ty) => {
        <$scalar>::default()
    };
}

macro_rules! define_py_schedule_output {
    ({} $( $(#[doc = $doc:tt])* $scope:ident $name:ident : $kind:tt ),* $(,)?) => {
        /// The schedule of one step (frozen; picklable). Arrays are read-only: request ids
        /// uint64; starts, lengths and positions int64; owner ranks, batch slots, token and
        /// block ids int32; flags bool. Every field is identical on every rank except those
        /// in `PER_RANK_FIELDS`; those of `COMPUTED_FIELDS` (the owner ranks and the
        /// per-rank ones, from the positions and this rank's placement; `sample_ids`, from
        /// the generation and context entries) are computed when first read.
        #[pyclass(frozen, module = "helix_kv._core", name = "ScheduleOutput")]
        pub struct PyScheduleOutput {
            $( $(#[doc = $doc])* #[pyo3(get)] $name: py_field_type!($kind), )*
            /// This rank and its group's layout: what the computed arrays are computed from.
            rank_placement: RankPlacement,
            /// The fingerprint of the configuration that scheduled the step, the digest's
            /// seed: what `_from_fields` recomputes the digest with.
            config_fingerprint: u64,
            /// The computed arrays, once read.
            computed: ComputedArrays,
            /// The scheduler's spare slot, for an output that a scheduler made: where the
            /// buffers Python never read go when the output is dropped.
            spare: Option<SpareOutput>,
        }

        impl PyScheduleOutput {
            /// The Python form of `out`, scheduled under `config_fingerprint`.
            fn new(out: ScheduleOutput, config_fingerprint: u64) -> Self {
                Self {
                    $( $name: from_core_field!(out.$name, $kind), )*
                    rank_placement: out.rank_placement,
                    config_fingerprint,
                    computed: ComputedArrays::default(),
                    spare: None,
                }
            }
        }

        /// Leaves the buffers of the arrays Python never read in the scheduler's spare
        /// slot (when it is empty): the next `schedule()` builds in them.
        impl Drop for PyScheduleOutput {
            fn drop(&mut self) {
                let Some(spare) = self.spare.take() else {
                    return;
                };
                spare.offer(|| ScheduleOutput {
                    $( $name: spare_field!(self.$name, $kind), )*
                    rank_placement: self.rank_placement,
                });
            }
        }

        impl PyScheduleOutput {
            /// The core output again, from the arrays as they are now.
            fn to_core(&self, py: Python<'_>) -> ScheduleOutput {
                ScheduleOutput {
                    $( $name: to_core_field!(self.$name, py, $kind), )*
                    rank_placement: self.rank_placement,
                }
            }

            /// Every stored field by name (numpy arrays and ints), then the placement
            /// (`PLACEMENT_FIELDS`, ints) and `config_fingerprint`; not the computed arrays
            /// (`COMPUTED_FIELDS`), computed from them.
            fn field_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let dict = PyDict::new(py);
                $( dict.set_item(stringify!($name), field_object!(self.$name, py, $kind))?; )*
                let placement = self.rank_placement;
                let values = [placement.cp_rank(), placement.cp_size(), placement.tokens_per_block()];
                for (name, value) in PLACEMENT_FIELDS.into_iter().zip(values) {
                    dict.set_item(name, value)?;
                }
                dict.set_item(FINGERPRINT_FIELD, self.config_fingerprint)?;
                Ok(dict)
            }

            /// An output from [`Self::field_dict`]'s form; every stored field, the placement
            /// and the fingerprint must be present (the computed arrays and the digest are
            /// checked by the caller).
            fn from_field_dict(fields: &Bound<'_, PyDict>) -> PyResult<Self> {
                let field = |name: &str| {
                    fields.get_item(name)?.ok_or_else(|| {
                        InvalidArgumentError::new_err(format!("ScheduleOutput field {name} is missing"))
                    })
                };
                Ok(Self {
                    $( $name: field_from_object!(&field(stringify!($name))?, stringify!($name), $kind), )*
                    rank_placement: placement_from_fields(&field)?,
                    config_fingerprint: u64_arg(
                        &field(FINGERPRINT_FIELD)?,
                        &format!("ScheduleOutput field {FINGERPRINT_FIELD}"),
                    )?,
                    computed: ComputedArrays::default(),
                    spare: None,
                })
            }
        }
    };
}

helix_kv_core::schedule_output_fields!(define_py_schedule_output! {});

/// A scheduler's spare output: one slot, shared by the scheduler and the outputs it made.
/// An output that Python drops leaves the buffers it never handed to numpy there (if the
/// slot is empty), and the next `schedule()` takes them
/// ([`helix_kv_core::Scheduler::recycle_output`]), so a step that is read and dropped
/// allocates none of its arrays. Only allocations travel through it: nothing a step
/// decides depends on what is in it.
#[derive(Clone, Default)]
pub struct SpareOutput(Arc<Mutex<Option<ScheduleOutput>>>);

impl SpareOutput {
    /// What the slot holds, leaving it empty.
    pub fn take(&self) -> Option<ScheduleOutput> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }

    /// Fills the slot with `make()` if it is empty and free (never waits for it).
    fn offer(&self, make: impl FnOnce() -> ScheduleOutput) {
        if let Ok(mut slot) = self.0.try_lock() {
            if slot.is_none() {
                *slot = Some(make());
            }
        }
    }
}

impl PyScheduleOutput {
    /// The Python form of a scheduler's output `out`, which leaves its unread buffers in
    /// `spare` when dropped.
    /// `out`, `config_fingerprint` the scheduler's.
    pub fn recycled_into(
        out: ScheduleOutput,
        config_fingerprint: u64,
        spare: &SpareOutput,
    ) -> Self {
        let mut output = Self::new(out, config_fingerprint);
        output.spare = Some(spare.clone());
        output
    }
}

/// The keys of the placement in a pickled output (`__reduce__`, `_from_fields`), which are
/// also the output's attributes of those names.
const PLACEMENT_FIELDS: [&str; 3] = ["cp_rank", "cp_size", "tokens_per_block"];

/// The key of the configuration fingerprint in a pickled output, also the attribute.
const FINGERPRINT_FIELD: &str = "config_fingerprint";

/// The placement from `_from_fields`'s values: each a non-negative integer (below 2**32),
/// a valid layout, and a rank of it; anything else an `InvalidArgumentError` (or an
/// `InvalidTypeError` for a value that is no integer).
fn placement_from_fields<'py>(
    field: &impl Fn(&str) -> PyResult<Bound<'py, PyAny>>,
) -> PyResult<RankPlacement> {
    let mut values = [0u32; 3];
    for (value, name) in values.iter_mut().zip(PLACEMENT_FIELDS) {
        let what = format!("ScheduleOutput field {name}");
        *value = int_arg(
            &field(name)?,
            &what,
            "0..=2**32-1",
            InvalidArgumentError::new_err,
        )?;
    }
    let [rank, cp, tokens_per_block] = values;
    let layout = Layout::new(cp, tokens_per_block).map_err(|error| {
        InvalidArgumentError::new_err(format!("ScheduleOutput placement: {error}"))
    })?;
    RankPlacement::new(layout, rank).py()
}

/// The computed arrays of an output, each computed on first read (from the positions and
/// the placement, or the entries for `sample_ids`) and cached.
struct ComputedArrays {
    owner_ranks: PyOnceLock<Py<PyArray1<i32>>>,
    sample_ids: PyOnceLock<Py<PyArray1<u64>>>,
    active: PyOnceLock<Py<PyArray1<bool>>>,
    local_lens: PyOnceLock<Py<PyArray1<i64>>>,
    past_seen_lens: PyOnceLock<Py<PyArray1<i64>>>,
}

impl Default for ComputedArrays {
    fn default() -> Self {
        Self {
            owner_ranks: PyOnceLock::new(),
            sample_ids: PyOnceLock::new(),
            active: PyOnceLock::new(),
            local_lens: PyOnceLock::new(),
            past_seen_lens: PyOnceLock::new(),
        }
    }
}

/// `values` as a read-only numpy array.
fn read_only_array<N: Element>(py: Python<'_>, values: Vec<N>) -> Py<PyArray1<N>> {
    let array = PyArray1::from_vec(py, values);
    make_read_only(&array);
    array.unbind()
}

/// `cell`'s array, made read-only from `values()` on first use.
fn cached_array<'py, N: Element>(
    py: Python<'py>,
    cell: &PyOnceLock<Py<PyArray1<N>>>,
    values: impl FnOnce() -> Vec<N>,
) -> Bound<'py, PyArray1<N>> {
    cell.get_or_init(py, || read_only_array(py, values()))
        .bind(py)
        .clone()
}

impl PyScheduleOutput {
    /// `cell`'s array, made on first use from the positions by `column` (one of the
    /// placement's columns, its values in numpy's type).
    fn computed_array<'py, N: Element>(
        &self,
        py: Python<'py>,
        cell: &PyOnceLock<Py<PyArray1<N>>>,
        column: impl FnOnce(RankPlacement, &[u64]) -> Vec<N>,
    ) -> Bound<'py, PyArray1<N>> {
        cached_array(py, cell, || {
            let positions = self.generation_positions.lend(py);
            column(self.rank_placement, positions.as_slice())
        })
    }

    /// The sample ids from the entries where they lie (see
    /// [`ScheduleOutput::sample_ids_of`]), handed to `read`.
    fn with_sample_ids<R>(
        &self,
        py: Python<'_>,
        read: impl FnOnce(&mut dyn ExactSizeIterator<Item = RequestId>) -> R,
    ) -> R {
        let context_ids = self.context_ids.lend(py);
        let context_completes = self.context_completes.lend(py);
        let generation_ids = self.generation_ids.lend(py);
        let draft_counts = self.generation_draft_counts.lend(py);
        let mut ids = ScheduleOutput::sample_ids_of(
            generation_ids.as_slice(),
            draft_counts.as_slice(),
            context_ids.as_slice(),
            context_completes.as_slice(),
        );
        read(&mut ids)
    }

    /// The computed arrays `fields` gives, if any (old pickles, callers that copy every
    /// name of `FIELDS`): each must be a numpy array of its dtype equal to what this
    /// output computes, or the output is refused (`InvalidArgumentError`).
    fn check_given_computed(&self, fields: &Bound<'_, PyDict>) -> PyResult<()> {
        /// What the placement columns are computed from.
        const PLACED: &str = "cp_rank, cp_size and tokens_per_block give for generation_positions";
        fn check<T: Exposed<N> + PartialEq, N: Element + Copy>(
            given: Option<Bound<'_, PyAny>>,
            name: &str,
            from: &str,
            computed: impl Iterator<Item = T>,
        ) -> PyResult<()> {
            let Some(given) = given else {
                return Ok(());
            };
            let given = LazyArray::<T, N>::from_object(&given, name)?.take_vector();
            if given.into_iter().ne(computed) {
                return Err(InvalidArgumentError::new_err(format!(
                    "ScheduleOutput field {name} is not what {from} (it is computed from them: \
                     leave it out)"
                )));
            }
            Ok(())
        }
        /// Placement column `name`, checked if `fields` gives it.
        fn check_placed<T: Exposed<N> + PartialEq, N: Element + Copy>(
            fields: &Bound<'_, PyDict>,
            name: &str,
            computed: impl Iterator<Item = T>,
        ) -> PyResult<()> {
            check::<T, N>(fields.get_item(name)?, name, PLACED, computed)
        }
        let py = fields.py();
        let [owners, samples, active, local, past] = COMPUTED_NAMES;
        if let Some(given) = fields.get_item(samples)? {
            self.with_sample_ids(py, |computed| {
                check::<RequestId, u64>(
                    Some(given),
                    samples,
                    "generation_ids, context_ids and context_completes give",
                    computed,
                )
            })?;
        }
        let placement = self.rank_placement;
        let positions = self.generation_positions.lend(py);
        let positions = positions.as_slice();
        check_placed::<u32, i32>(fields, owners, placement.owner_ranks(positions))?;
        check_placed::<bool, bool>(fields, active, placement.active(positions))?;
        check_placed::<u64, i64>(fields, local, placement.local_lens(positions))?;
        check_placed::<u64, i64>(fields, past, placement.past_seen_lens(positions))
    }
}

/// `generation_owner_ranks` of `positions`, as numpy holds it.
fn owner_column(placement: RankPlacement, positions: &[u64]) -> Vec<i32> {
    let owners = placement.owner_ranks(positions);
    owners.map(<u32 as Exposed<i32>>::to_numpy).collect()
}

/// `generation_active` of `positions` on the placement's rank.
fn active_column(placement: RankPlacement, positions: &[u64]) -> Vec<bool> {
    placement.active(positions).collect()
}

/// `generation_local_lens` of `positions` on the placement's rank, as numpy holds them.
fn local_len_column(placement: RankPlacement, positions: &[u64]) -> Vec<i64> {
    let lens = placement.local_lens(positions);
    lens.map(<u64 as Exposed<i64>>::to_numpy).collect()
}

/// `generation_past_seen_lens` of `positions` on the placement's rank, as numpy holds them.
fn past_seen_len_column(placement: RankPlacement, positions: &[u64]) -> Vec<i64> {
    let lens = placement.past_seen_lens(positions);
    lens.map(<u64 as Exposed<i64>>::to_numpy).collect()
}

impl PyScheduleOutput {
    /// The step's digest.
    pub fn digest_value(&self) -> u64 {
        self.digest
    }

    /// The positions of the step's decodes, as Python would read them.
    pub fn positions(&self, py: Python<'_>) -> Lent<'_, u64> {
        self.generation_positions.lend(py)
    }

    /// The placement its per-rank columns are computed from, for the cross-rank check of an
    /// in-process group ([`crate::rank_group`]), which reads them row by row from it: that
    /// check runs on outputs made in the same call, whose columns Python has not read, so
    /// the placement's values are the columns Python would read.
    pub fn unread_placement(&self, py: Python<'_>) -> RankPlacement {
        let computed = &self.computed;
        debug_assert!(
            computed.owner_ranks.get(py).is_none()
                && computed.active.get(py).is_none()
                && computed.local_lens.get(py).is_none()
                && computed.past_seen_lens.get(py).is_none(),
            "a column of an output made in this call was read"
        );
        self.rank_placement
    }
}

/// The core's computed column names, in its order: the getters below are these names.
const COMPUTED_NAMES: [&str; 5] = [
    ScheduleOutput::COMPUTED_FIELDS[0].0,
    ScheduleOutput::COMPUTED_FIELDS[1].0,
    ScheduleOutput::COMPUTED_FIELDS[2].0,
    ScheduleOutput::COMPUTED_FIELDS[3].0,
    ScheduleOutput::COMPUTED_FIELDS[4].0,
];

/// Field names as a tuple.
fn names(
    py: Python<'_>,
    names: impl IntoIterator<Item = &'static str>,
) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(py, names.into_iter().collect::<Vec<_>>())
}

#[pymethods]
impl PyScheduleOutput {
    /// Every field name: the stored fields in order, `generation_owner_ranks` after
    /// `generation_positions` and `sample_ids` after `sat_out_ids` (where they were once
    /// stored), then the per-rank ones (`PER_RANK_FIELDS`); those of `COMPUTED_FIELDS` are
    /// computed when read.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn FIELDS(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        names(py, ScheduleOutput::all_fields().map(|(name, _)| name))
    }
    /// The fields identical on every rank that scheduled alike (`digest` among them).
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn RANK_INVARIANT_FIELDS(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        names(
            py,
            ScheduleOutput::fields_with_scope(FieldScope::RankInvariant),
        )
    }
    /// The fields that differ by rank by design (this rank's share of the KV): not
    /// stored, each computed from `generation_positions` and the placement
    /// (`PLACEMENT_FIELDS`) the first time it is read, then cached.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn PER_RANK_FIELDS(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        names(py, ScheduleOutput::fields_with_scope(FieldScope::PerRank))
    }
    /// The fields not stored, in `FIELDS` order: `generation_owner_ranks` and `sample_ids`
    /// (rank-invariant), then the per-rank ones; each computed the first time it is read
    /// (the owner ranks and the per-rank ones from `generation_positions` and the placement,
    /// `sample_ids` from the generation and context entries), then cached. Pickles leave
    /// them out; `_from_fields` accepts them only as what it computes.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn COMPUTED_FIELDS(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        names(py, COMPUTED_NAMES)
    }
    /// This rank's placement in its group, what the computed fields are computed from:
    /// attributes of the output, and keys of its pickled form (`_from_fields`).
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn PLACEMENT_FIELDS(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        names(py, PLACEMENT_FIELDS)
    }
    /// The entries of `summary_fields()`, in order, each with the fields its value shows.
    #[classattr]
    #[expect(non_snake_case, reason = "a Python class constant")]
    fn SUMMARY_ENTRIES(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
        let entries = ScheduleOutput::SUMMARY_ENTRIES
            .iter()
            .map(|(entry, shown)| Ok((*entry, names(py, shown.iter().copied())?)))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(py, entries)
    }

    /// Rank that appends each generation entry's token: `(pos // tokens_per_block) %
    /// cp_size`, the same on every rank. Computed from `generation_positions` and the
    /// placement on first read, then cached.
    #[getter]
    fn generation_owner_ranks<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.computed_array(py, &self.computed.owner_ranks, owner_column)
    }
    /// Per rank: whether this rank is the owner (appends the token's KV). Computed from
    /// `generation_positions` and the placement on first read, then cached.
    #[getter]
    fn generation_active<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        self.computed_array(py, &self.computed.active, active_column)
    }
    /// Per rank: tokens this rank holds after the append. Computed from
    /// `generation_positions` and the placement on first read, then cached.
    #[getter]
    fn generation_local_lens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.computed_array(py, &self.computed.local_lens, local_len_column)
    }
    /// Per rank: tokens this rank holds before the append. Computed from
    /// `generation_positions` and the placement on first read, then cached.
    #[getter]
    fn generation_past_seen_lens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.computed_array(py, &self.computed.past_seen_lens, past_seen_len_column)
    }
    /// The rank this output is for.
    #[getter]
    fn cp_rank(&self) -> u32 {
        self.rank_placement.cp_rank()
    }
    /// Ranks in the group.
    #[getter]
    fn cp_size(&self) -> u32 {
        self.rank_placement.cp_size()
    }
    /// Tokens in one page on one rank.
    #[getter]
    fn tokens_per_block(&self) -> u32 {
        self.rank_placement.tokens_per_block()
    }
    /// The fingerprint of the configuration that scheduled this step
    /// (`SchedulerConfig.fingerprint`, the same on every rank): the seed of `digest`, which
    /// `_from_fields` recomputes from it and the fields.
    #[getter]
    fn config_fingerprint(&self) -> u64 {
        self.config_fingerprint
    }

    /// Generation ids (each `1 + drafts` times: its decode row, then one per draft), then
    /// the ids of context entries that complete their prompt: the order of the tokens
    /// `update` takes. Computed from `generation_ids`, `context_ids`
    /// and `context_completes` on first read, then cached.
    #[getter]
    fn sample_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        cached_array(py, &self.computed.sample_ids, || {
            self.with_sample_ids(py, |ids| ids.map(<u64 as Exposed<u64>>::to_numpy).collect())
        })
    }

    /// Tokens `update` expects (`len(sample_ids)`), counted from the entries without
    /// building that array.
    #[getter]
    fn num_samples(&self, py: Python<'_>) -> usize {
        let context_completes = self.context_completes.lend(py);
        let draft_tokens = self.generation_draft_tokens.len(py);
        ScheduleOutput::num_samples_of(
            self.generation_ids.len(py),
            draft_tokens,
            context_completes.as_slice(),
        )
    }
    /// The summary as `(entry, value)` pairs: the entries of `SUMMARY_ENTRIES`, each value
    /// stable text, so two ranks' entries compare as strings.
    fn summary_fields(&self, py: Python<'_>) -> Vec<(&'static str, String)> {
        self.to_core(py).summary_fields()
    }
    /// One `name: value` line per entry of `summary_fields()`, stable text to diff two
    /// ranks'.
    fn summary(&self, py: Python<'_>) -> String {
        self.to_core(py).summary()
    }
    /// The rank-invariant fields in which `other` (another rank's output of the same step)
    /// differs from this one, in `FIELDS` order.
    fn differing_fields(
        &self,
        py: Python<'_>,
        other: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<&'static str>> {
        let other = other
            .cast::<Self>()
            .map_err(|_| invalid_type_of("other", "a ScheduleOutput", other))?;
        Ok(self.to_core(py).differing_fields(&other.get().to_core(py)))
    }
    /// Equal when every field and the placement are (so the computed ones too): a pickled
    /// copy equals its original, another rank's output of the same step does not.
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        let Ok(other) = other.cast::<Self>() else {
            return Ok(py.NotImplemented());
        };
        let equal = self.to_core(py) == other.get().to_core(py);
        Ok(equal.into_pyobject(py)?.to_owned().into_any().unbind())
    }
    /// From the digest: equal outputs have equal digests (it is one of the fields compared).
    fn __hash__(&self) -> u64 {
        self.digest
    }
    /// Pickles as `ScheduleOutput._from_fields({field: value})`: the stored fields, the
    /// placement (`PLACEMENT_FIELDS`) and `config_fingerprint`, not the fields computed from
    /// them (`COMPUTED_FIELDS`).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let rebuild = py.get_type::<Self>().getattr("_from_fields")?;
        let args = PyTuple::new(py, [slf.get().field_dict(py)?])?;
        PyTuple::new(py, [rebuild, args.into_any()])
    }
    /// Rebuilds a pickled output from its fields: every stored field (arrays of the
    /// fields' dtypes, no negative length, position, count or rank; the array lengths must
    /// fit together), the placement (`PLACEMENT_FIELDS`: a rank of a valid layout) and
    /// `config_fingerprint`. The computed fields (`COMPUTED_FIELDS`) may be left out; any
    /// given must equal what the output computes (the placement for the positions; the
    /// entries for `sample_ids`), or the output is refused. So must `digest`: it is
    /// recomputed from the fields and the fingerprint by the scheduler's own digest, so an
    /// output changed after it was scheduled cannot pass for the scheduled one
    /// (`InvalidArgumentError`).
    #[classmethod]
    fn _from_fields(_cls: &Bound<'_, PyType>, fields: &Bound<'_, PyAny>) -> PyResult<Self> {
        let fields = fields
            .cast::<PyDict>()
            .map_err(|_| invalid_type_of("fields", "a dict", fields))?;
        let output = Self::from_field_dict(fields)?;
        let core = output.to_core(fields.py());
        core.check_lengths().py()?;
        output.check_given_computed(fields)?;
        core.check_digest(output.config_fingerprint).py()?;
        Ok(output)
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "ScheduleOutput(step={}, context={}, generation={}, preempted={}, suspended={}, \
             sat_out={}, num_tokens={}, digest=0x{:016x})",
            self.step,
            self.context_ids.len(py),
            self.generation_ids.len(py),
            self.preempted_ids.len(py),
            self.suspended_ids.len(py),
            self.sat_out_ids.len(py),
            self.num_tokens,
            self.digest
        )
    }
}

/// A field's values lent where they lie: under the field's lock while they are still the
/// core's vector (no copy: the fast path, for fields Python never read), or converted back
/// from the numpy array Python read. Held with the GIL: a first read of the same field by
/// another thread takes that lock while holding the GIL.
pub enum Lent<'a, T> {
    Locked(std::sync::MutexGuard<'a, Option<Vec<T>>>),
    Copied(Vec<T>),
}

impl<T: Clone> Lent<'_, T> {
    pub fn as_slice(&self) -> &[T] {
        match self {
            Self::Locked(guard) => guard.as_deref().unwrap_or(&[]),
            Self::Copied(values) => values,
        }
    }
    /// The values owned, so the lock is not held: copied out of a lock, moved otherwise.
    fn into_owned(self) -> Lent<'static, T> {
        match self {
            Self::Locked(guard) => Lent::Copied(guard.as_deref().unwrap_or(&[]).to_vec()),
            Self::Copied(values) => Lent::Copied(values),
        }
    }
}

impl<T: Exposed<N>, N: Element + Copy> LazyArray<T, N> {
    fn lend(&self, py: Python<'_>) -> Lent<'_, T> {
        if self.array.get(py).is_some() {
            return Lent::Copied(self.values(py));
        }
        Lent::Locked(
            self.vector
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// Defines [`LentStep`] from the one list of the fields the step metadata is made of (the
/// core's [`helix_kv_core::StepSource`]): the scalars copied, the arrays lent. With it come
/// the output's `lend_step` and the lent step's `into_owned` and `source`, field for field.
macro_rules! define_lent_step {
    (scalars { $($scalar:ident),* $(,)? } arrays { $($array:ident : $element:ty),* $(,)? }) => {
        /// The fields the step metadata is made of, lent by a [`PyScheduleOutput`].
        pub struct LentStep<'a> {
            $( $scalar: u64, )*
            $( $array: Lent<'a, $element>, )*
        }

        impl LentStep<'_> {
            /// The fields owned (moved where they were copies already, copied out of the
            /// output's locks otherwise), so the GIL may be released while they are read.
            pub fn into_owned(self) -> LentStep<'static> {
                LentStep {
                    $( $scalar: self.$scalar, )*
                    $( $array: self.$array.into_owned(), )*
                }
            }

            /// The core's borrowed view of the lent fields.
            pub fn source(&self) -> helix_kv_core::StepSource<'_> {
                helix_kv_core::StepSource {
                    $( $scalar: self.$scalar, )*
                    $( $array: self.$array.as_slice(), )*
                }
            }
        }

        impl PyScheduleOutput {
            /// Lends the fields the step metadata is made of (see [`Lent`]).
            pub fn lend_step(&self, py: Python<'_>) -> LentStep<'_> {
                LentStep {
                    $( $scalar: self.$scalar, )*
                    $( $array: self.$array.lend(py), )*
                }
            }
        }
    };
}

define_lent_step! {
    scalars { step, digest }
    arrays {
        context_ids: RequestId,
        context_starts: u64,
        context_lens: u64,
        context_completes: bool,
        context_batch_slots: i32,
        context_token_ids: i32,
        generation_ids: RequestId,
        generation_positions: u64,
        generation_input_tokens: i32,
        generation_input_refs: i32,
        generation_batch_slots: i32,
        generation_draft_counts: u64,
        generation_draft_tokens: i32,
    }
}
