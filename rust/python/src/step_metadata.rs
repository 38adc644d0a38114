//! Packed step metadata: `StepMetadataLayout` (where each section of the caller's int32
//! buffer lies), `StepMetadata` (the counts of one written step) and the two `Scheduler`
//! methods behind them (`step_metadata_layout`, `write_step_metadata`); the decode rows
//! (`DECODE_ROW_COLUMNS`, `DecodeRowCounts`, `write_decode_rows`).

use helix_kv_core::{CoreError, Scheduler, StepMetadataLayout, StepSource};
use numpy::ndarray::{Dimension, Ix1, Ix2};
use numpy::{PyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::arrays::{int_arg, invalid_type_of};
use crate::errors::{invalid_type, IntoPyResult, InvalidArgumentError, InvalidLengthError};
use crate::schedule_output::PyScheduleOutput;

value_record! {
    {
    /// The counts of one step written by `Scheduler.write_step_metadata` (frozen; also in the
    /// buffer's header section).
    PyStepMetadata as "StepMetadata" from helix_kv_core::StepMetadata
    }
    /// The step written.
    step: u64,
    /// Tokens written: generation inputs, then context tokens.
    num_tokens: usize,
    /// Entries written: generation entries, then context chunks.
    num_entries: usize,
    /// Generation entries (entries `0..num_generation`, tokens
    /// `0..num_generation + num_draft_tokens`: each entry's input token, then its drafts).
    num_generation: usize,
    /// Sampled rows (the length of `sample_ids`): without drafts, the rows of `sample_rows`
    /// written; with drafts, `sample_rows` holds each generation entry's first row (all its
    /// `1 + drafts` rows are sampled), then each completing chunk's last row.
    num_samples: usize,
    /// The widest table among the entries, in superblocks (columns past it are -1).
    table_width_used: usize,
    /// Draft tokens the generation entries verify (speculative decoding; 0 without).
    num_draft_tokens: usize,
}

/// Where each section of the packed step metadata lies in the caller's int32 buffer
/// (frozen; picklable). It depends on the capacities only, so one buffer and one set of
/// views serve every step.
#[pyclass(frozen, eq, module = "helix_kv._core", name = "StepMetadataLayout")]
#[derive(Clone, PartialEq)]
pub struct PyStepMetadataLayout {
    pub inner: StepMetadataLayout,
}

fn capacity(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    int_arg::<u32>(obj, what, "0..=2**32-1", InvalidLengthError::new_err)
}

#[pymethods]
impl PyStepMetadataLayout {
    /// The layout for steps of at most `max_tokens` tokens and `max_entries` entries, with
    /// block-table rows of `table_width` superblocks.
    #[new]
    fn new(
        max_tokens: &Bound<'_, PyAny>,
        max_entries: &Bound<'_, PyAny>,
        table_width: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let inner = StepMetadataLayout::new(
            capacity(max_tokens, "max_tokens")?,
            capacity(max_entries, "max_entries")?,
            capacity(table_width, "table_width")?,
        )
        .py()?;
        Ok(Self { inner })
    }
    /// Tokens one step may hold.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.inner.max_tokens()
    }
    /// Entries one step may hold.
    #[getter]
    fn max_entries(&self) -> usize {
        self.inner.max_entries()
    }
    /// Superblocks per block-table row.
    #[getter]
    fn table_width(&self) -> usize {
        self.inner.table_width()
    }
    /// Words (int32) the buffer must hold at least.
    #[getter]
    fn total_words(&self) -> usize {
        self.inner.total_words()
    }
    /// Every section in buffer order, as `(name, offset_words, length, dtype)`: its first
    /// element is word `offset_words` of the buffer, it holds `length` elements and `dtype`
    /// is `"int32"` or `"int64"` (two words an element, at an even offset).
    #[getter]
    fn sections<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let items = self
            .inner
            .sections()
            .iter()
            .map(|s| {
                (
                    s.name,
                    s.offset_words,
                    s.len,
                    if s.int64 { "int64" } else { "int32" },
                )
            })
            .collect::<Vec<_>>();
        PyTuple::new(py, items)
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let inner = &slf.get().inner;
        let args = (inner.max_tokens(), inner.max_entries(), inner.table_width());
        PyTuple::new(
            slf.py(),
            [
                slf.get_type().into_any(),
                args.into_pyobject(slf.py())?.into_any(),
            ],
        )
    }
    fn __repr__(&self) -> String {
        format!(
            "StepMetadataLayout(max_tokens={}, max_entries={}, table_width={})",
            self.inner.max_tokens(),
            self.inner.max_entries(),
            self.inner.table_width()
        )
    }
}

/// `Scheduler.step_metadata_layout`.
pub fn layout(
    scheduler: &Scheduler,
    table_width: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyStepMetadataLayout> {
    let width = table_width
        .map(|w| capacity(w, "table_width"))
        .transpose()?;
    Ok(PyStepMetadataLayout {
        inner: scheduler.step_metadata_layout(width).py()?,
    })
}

/// The error for a buffer whose dtype is not native int32.
fn not_int32(untyped: &Bound<'_, PyUntypedArray>) -> PyErr {
    invalid_type(format!(
        "buffer must have dtype int32 (native byte order), got {}",
        untyped
            .dtype()
            .str()
            .map_or_else(|_| "?".to_string(), |s| s.to_string())
    ))
}

/// The caller's `obj` as a C-contiguous, aligned numpy int32 array of `D`'s rank (`shape`
/// names that rank in the error): a wrong type or dtype is an `InvalidTypeError`, a wrong
/// rank, a strided or a misaligned array an `InvalidArgumentError` (it is written in place,
/// so it cannot be copied as an input is).
fn int32_array<'py, D: Dimension>(
    obj: &Bound<'py, PyAny>,
    shape: &str,
) -> PyResult<Bound<'py, PyArray<i32, D>>> {
    let untyped = obj
        .cast::<PyUntypedArray>()
        .map_err(|_| invalid_type_of("buffer", "a numpy int32 array", obj))?;
    if D::NDIM.is_some_and(|ndim| untyped.ndim() != ndim) {
        return Err(InvalidArgumentError::new_err(format!(
            "buffer must be {shape}, got an array of shape {:?}",
            untyped.shape()
        )));
    }
    let array = untyped
        .cast::<PyArray<i32, D>>()
        .map_err(|_| not_int32(untyped))?;
    if !array.is_c_contiguous() {
        return Err(InvalidArgumentError::new_err(
            "buffer must be C-contiguous (a strided view cannot be filled in place)",
        ));
    }
    if !array.is_aligned() {
        return Err(InvalidArgumentError::new_err(
            "buffer must be aligned to its int32 elements (a view at an odd byte offset cannot be \
             filled in place)",
        ));
    }
    Ok(array.clone())
}

/// The caller's buffer, refused unless it is a one-dimensional, C-contiguous, writeable
/// numpy array of native int32 whose start is 8-byte aligned (so the int64 sections can be
/// viewed in place). A wrong type or dtype is an `InvalidTypeError`; a wrong shape,
/// layout, alignment or a read-only array an `InvalidArgumentError`.
fn int32_buffer<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let array = int32_array::<Ix1>(obj, "one-dimensional")?;
    if (array.data() as usize) % 8 != 0 {
        return Err(InvalidArgumentError::new_err(
            "buffer must start at an 8-byte aligned address (its int64 sections are viewed in place)",
        ));
    }
    Ok(array)
}

/// Tokens plus entries up to which `write_step_metadata` keeps the GIL (about 50 us of work).
const KEEP_GIL_UP_TO: usize = 1 << 14;

/// The `schedule_output` argument of both `Scheduler.write_*` methods.
fn schedule_output_arg<'a, 'py>(
    obj: &'a Bound<'py, PyAny>,
) -> PyResult<&'a Bound<'py, PyScheduleOutput>> {
    obj.cast::<PyScheduleOutput>()
        .map_err(|_| invalid_type_of("schedule_output", "a ScheduleOutput", obj))
}

/// What both `Scheduler.write_*` methods end with: `write` fills the words of `array` (the
/// caller's checked buffer, refused unless writeable and not borrowed elsewhere) from
/// `output`'s step. A call `keep_gil` calls short (given the step's fields) keeps the GIL:
/// the output's arrays are lent in place (see `Lent`: their locks cannot be held while the
/// GIL is let go), and the call takes about what copying them out and handing the GIL over
/// and back would. A longer one copies the fields out of their locks (a fraction of the
/// writing), then writes with the GIL released.
fn write_step<D: Dimension, T: Send>(
    py: Python<'_>,
    output: &Bound<'_, PyScheduleOutput>,
    array: &Bound<'_, PyArray<i32, D>>,
    keep_gil: impl FnOnce(&StepSource<'_>) -> bool,
    write: impl Send + FnOnce(StepSource<'_>, &mut [i32]) -> Result<T, CoreError>,
) -> PyResult<T> {
    let mut writable = array.try_readwrite().map_err(|_| {
        InvalidArgumentError::new_err(
            "buffer must be writeable and not borrowed elsewhere (a read-only array or view is refused)",
        )
    })?;
    let words = writable
        .as_slice_mut()
        .map_err(|_| InvalidArgumentError::new_err("buffer must be C-contiguous"))?;
    let lent = output.get().lend_step(py);
    if keep_gil(&lent.source()) {
        write(lent.source(), words)
    } else {
        let owned = lent.into_owned();
        py.detach(|| write(owned.source(), words))
    }
    .py()
}

/// `Scheduler.write_step_metadata`.
pub fn write(
    py: Python<'_>,
    scheduler: &Scheduler,
    schedule_output: &Bound<'_, PyAny>,
    buffer: &Bound<'_, PyAny>,
    layout: &Bound<'_, PyAny>,
) -> PyResult<PyStepMetadata> {
    let output = schedule_output_arg(schedule_output)?;
    let layout = layout
        .cast::<PyStepMetadataLayout>()
        .map_err(|_| invalid_type_of("layout", "a StepMetadataLayout", layout))?;
    let array = int32_buffer(buffer)?;
    let layout = &layout.get().inner;
    let metadata = write_step(
        py,
        output,
        &array,
        |source| {
            let tokens = source.generation_ids.len() + source.context_token_ids.len();
            tokens + source.context_ids.len() <= KEEP_GIL_UP_TO
        },
        |source, words| scheduler.write_step_metadata(source, layout, words),
    )?;
    Ok(metadata.into())
}

value_record! {
    {
    /// The counts of one decode-only step written by `Scheduler.write_decode_rows` (frozen).
    PyDecodeRowCounts as "DecodeRowCounts" from helix_kv_core::DecodeRowCounts
    }
    /// The step written.
    step: u64,
    /// Rows written: the generation entries, rows `0..rows`.
    rows: usize,
    /// Rows written up to: `rows..padded_to` are padding rows.
    padded_to: usize,
    /// Rows whose input token is still in flight (their `input_ref` column is `>= 0`).
    in_flight: usize,
    /// The widest table among the rows, in superblocks (block-table columns past it are -1).
    table_width_used: usize,
}

/// `DECODE_ROW_COLUMNS`: the fixed columns of a decode row in order, then `"block_table"`
/// (its first column): the index of a name is its column.
pub fn decode_row_columns() -> Vec<&'static str> {
    let mut names = helix_kv_core::decode_row::NAMES.to_vec();
    names.push("block_table");
    names
}

/// The caller's row buffer, refused unless it is a two-dimensional, C-contiguous numpy
/// array of native int32 (a wrong type or dtype is an `InvalidTypeError`, a wrong shape or
/// layout an `InvalidArgumentError`).
fn int32_rows<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray2<i32>>> {
    int32_array::<Ix2>(obj, "two-dimensional ([rows, width])")
}

/// Words of decode rows (written and padding rows) up to which `write_decode_rows` keeps
/// the GIL: 256 KiB of rows, tens of microseconds of work.
const KEEP_GIL_UP_TO_WORDS: usize = 1 << 16;

/// `Scheduler.write_decode_rows`.
pub fn write_rows(
    py: Python<'_>,
    scheduler: &Scheduler,
    schedule_output: &Bound<'_, PyAny>,
    buffer: &Bound<'_, PyAny>,
    pad_to: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyDecodeRowCounts> {
    let output = schedule_output_arg(schedule_output)?;
    let pad_to = pad_to
        .map(|p| int_arg::<usize>(p, "pad_to", "0..", InvalidLengthError::new_err))
        .transpose()?
        .unwrap_or(0);
    let array = int32_rows(buffer)?;
    let width = array.shape()[1];
    let counts = write_step(
        py,
        output,
        &array,
        |source| {
            source
                .generation_ids
                .len()
                .max(pad_to)
                .saturating_mul(width)
                <= KEEP_GIL_UP_TO_WORDS
        },
        |source, words| scheduler.write_decode_rows(source, words, width, pad_to),
    )?;
    Ok(counts.into())
}
