//! `Layout`: the Helix token placement, scalar and batch (numpy) forms.
#![expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "PyO3 methods receive `&self`; the class is a small `Copy` value"
)]

use helix_kv_core::Layout;
use numpy::PyArray1;
use pyo3::prelude::*;

use pyo3::types::PyTuple;

use crate::arrays::{length_arg, rank_arg, table_arg, u64_vec};
use crate::errors::{
    config_error, int_setting, invalid_type, with_config_value, IntoPyResult, InvalidLengthError,
};

/// Token placement for `cp_size` ranks with pages of `tokens_per_block` tokens (frozen, hashable,
/// picklable).
#[pyclass(frozen, eq, hash, module = "helix_kv._core", name = "Layout")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyLayout {
    pub inner: Layout,
}

#[pymethods]
impl PyLayout {
    #[new]
    #[pyo3(signature = (cp_size=None, tokens_per_block=None, *, cp=None))]
    fn new(
        py: Python<'_>,
        cp_size: Option<&Bound<'_, PyAny>>,
        tokens_per_block: Option<&Bound<'_, PyAny>>,
        cp: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let setting = |obj, name| int_setting::<u32>(obj, name, "1..=2**32-1");
        // Not given and given as None read alike (None is the keyword's default).
        let missing = |name: &str| {
            invalid_type(format!(
                "Layout() needs {name}: an int in 1..=2**32-1, got None"
            ))
        };
        let cp_size = match (cp_size, cp) {
            (Some(_), Some(_)) => {
                return Err(config_error(
                    "Layout() got both cp_size and its deprecated name cp; give cp_size only",
                    Some("cp_size"),
                    cp_size,
                ))
            }
            (Some(cp_size), None) => setting(cp_size, "cp_size")?,
            (None, Some(cp)) => {
                deprecated(py, c"Layout(cp=...) is deprecated: the keyword is cp_size")?;
                setting(cp, "cp_size")?
            }
            (None, None) => return Err(missing("cp_size")),
        };
        let tokens_per_block = setting(
            tokens_per_block.ok_or_else(|| missing("tokens_per_block"))?,
            "tokens_per_block",
        )?;
        let inner = Layout::new(cp_size, tokens_per_block).py().map_err(|err| {
            with_config_value(err, py, |field| {
                let value = if field == "cp_size" {
                    cp_size
                } else {
                    tokens_per_block
                };
                Ok(Some(value.into_pyobject(py)?.into_any()))
            })
        })?;
        Ok(Self { inner })
    }

    /// Ranks in the CP group.
    #[getter]
    fn cp_size(&self) -> u32 {
        self.inner.cp()
    }

    /// Deprecated name of `cp_size` (kept for one release).
    #[getter]
    fn cp(&self, py: Python<'_>) -> PyResult<u32> {
        deprecated(py, c"Layout.cp is deprecated: read Layout.cp_size")?;
        Ok(self.inner.cp())
    }

    /// Tokens in one physical page on one rank.
    #[getter]
    fn tokens_per_block(&self) -> u32 {
        self.inner.tokens_per_block()
    }

    /// Global tokens covered by one superblock (one page on each rank).
    #[getter]
    fn tokens_per_superblock(&self) -> u64 {
        self.inner.tokens_per_superblock()
    }

    /// Rank holding global position `pos`: `(pos // tokens_per_block) % cp`.
    fn owner_rank(&self, pos: &Bound<'_, PyAny>) -> PyResult<u32> {
        Ok(self.inner.owner_rank(length_arg(pos, "position")?))
    }

    /// Tokens of a length-`n` sequence held by `cp_rank`.
    fn local_len(&self, n: &Bound<'_, PyAny>, cp_rank: &Bound<'_, PyAny>) -> PyResult<u64> {
        let n = length_arg(n, "length")?;
        let rank = self.rank(cp_rank)?;
        Ok(self.inner.local_len(n, rank))
    }

    /// Superblocks a length-`n` sequence needs: `ceil(n / (tokens_per_block * cp))`.
    fn superblocks_for(&self, n: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.inner.superblocks_for(length_arg(n, "length")?))
    }

    /// Index of global position `pos` inside its owner's local sequence.
    fn local_index(&self, pos: &Bound<'_, PyAny>) -> PyResult<u64> {
        Ok(self.inner.local_index(length_arg(pos, "position")?))
    }

    /// Global position of the `local_index`-th token held by `cp_rank`; a position past
    /// `2**63 - 1` is an `InvalidLengthError`.
    fn global_position(
        &self,
        cp_rank: &Bound<'_, PyAny>,
        local_index: &Bound<'_, PyAny>,
    ) -> PyResult<i64> {
        let rank = self.rank(cp_rank)?;
        let index = length_arg(local_index, "local index")?;
        global_position(self.inner, rank, index)
    }

    /// Batch `owner_rank` (int32 out).
    fn owner_ranks<'py>(
        &self,
        positions: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let layout = self.inner;
        map_array(positions, "positions", |p| {
            Ok(rank_int32(layout.owner_rank(p)))
        })
    }

    /// Batch `local_len` for one rank (int64 out).
    fn local_lens<'py>(
        &self,
        lengths: &Bound<'py, PyAny>,
        cp_rank: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let rank = self.rank(cp_rank)?;
        let layout = self.inner;
        map_array(lengths, "lengths", |n| {
            Ok(result_int64(layout.local_len(n, rank)))
        })
    }

    /// Batch `superblocks_for` (int64 out).
    fn superblocks_for_many<'py>(
        &self,
        lengths: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let layout = self.inner;
        map_array(lengths, "lengths", |n| {
            Ok(result_int64(layout.superblocks_for(n)))
        })
    }

    /// Batch `global_position` for one rank (int64 out); a position past `2**63 - 1` is
    /// an `InvalidLengthError`.
    fn global_positions<'py>(
        &self,
        cp_rank: &Bound<'py, PyAny>,
        local_indices: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let rank = self.rank(cp_rank)?;
        let layout = self.inner;
        map_array(local_indices, "local indices", |i| {
            global_position(layout, rank, i)
        })
    }

    /// Batch slot mapping for a step run without a scheduler: the slot on `cp_rank` of each
    /// global position `positions[i]` of the request whose superblock table is row
    /// `rows[i]` of `block_table` (two-dimensional, padded with negative ids), or -1 where
    /// another rank owns the position (int64 out). Every position must fall inside its row's
    /// table on a page id, whichever rank owns it.
    fn slot_mapping<'py>(
        &self,
        block_table: &Bound<'py, PyAny>,
        rows: &Bound<'py, PyAny>,
        positions: &Bound<'py, PyAny>,
        cp_rank: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let py = block_table.py();
        let (table, width) = table_arg(block_table, "block table")?;
        let rows = u64_vec(rows, "rows", false)?;
        let positions = u64_vec(positions, "positions", true)?;
        let rank = rank_arg(cp_rank)?;
        let mut out = Vec::new();
        let layout = self.inner;
        py.detach(|| layout.slot_mapping_into(&table, width, &rows, &positions, rank, &mut out))
            .py()?;
        Ok(PyArray1::from_vec(py, out))
    }

    /// Pickles as `Layout(cp_size, tokens_per_block)`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let layout = slf.get().inner;
        let args = (layout.cp(), layout.tokens_per_block()).into_pyobject(py)?;
        PyTuple::new(py, [py.get_type::<Self>().into_any(), args.into_any()])
    }

    fn __repr__(&self) -> String {
        format!(
            "Layout(cp_size={}, tokens_per_block={})",
            self.inner.cp(),
            self.inner.tokens_per_block()
        )
    }
}

impl PyLayout {
    /// A rank of the group.
    fn rank(&self, cp_rank: &Bound<'_, PyAny>) -> PyResult<u32> {
        let rank = rank_arg(cp_rank)?;
        self.inner.check_rank(rank).py()?;
        Ok(rank)
    }
}

/// `layout.global_position`, refused where it would not fit int64 (every length and
/// position crosses the Python edge as int64).
fn global_position(layout: Layout, rank: u32, local_index: u64) -> PyResult<i64> {
    layout
        .checked_global_position(rank, local_index)
        .and_then(|pos| i64::try_from(pos).ok())
        .ok_or_else(|| {
            InvalidLengthError::new_err(format!(
                "local index {local_index} on rank {rank} is past the largest position (2**63-1)"
            ))
        })
}

/// A rank as numpy's int32 (`owner_ranks`, `ScheduleOutput.generation_owner_ranks`).
#[expect(
    clippy::cast_possible_wrap,
    reason = "ranks are below cp, and `Layout::new` caps cp * tokens_per_block at 2**24"
)]
pub fn rank_int32(rank: u32) -> i32 {
    debug_assert!(i32::try_from(rank).is_ok());
    rank as i32
}

/// A `local_len` or `superblocks_for` result as numpy's int64.
#[expect(
    clippy::cast_possible_wrap,
    reason = "at most the length it was computed from, which `u64_vec` kept in 0..=2**63-1"
)]
fn result_int64(value: u64) -> i64 {
    debug_assert!(i64::try_from(value).is_ok());
    value as i64
}

/// Applies `f` to every element of an array-like of lengths or positions
/// (`0..=2**63-1`).
fn map_array<'py, T: numpy::Element + Send>(
    values: &Bound<'py, PyAny>,
    what: &str,
    f: impl Fn(u64) -> PyResult<T> + Send,
) -> PyResult<Bound<'py, PyArray1<T>>> {
    let py = values.py();
    let values = u64_vec(values, what, true)?;
    // The per-element work runs with the GIL released (large batches are the point).
    let out = py.detach(|| values.into_iter().map(f).collect::<PyResult<Vec<T>>>())?;
    Ok(PyArray1::from_vec(py, out))
}

/// Warns that a deprecated name was used (a `DeprecationWarning` pointing at the caller).
fn deprecated(py: Python<'_>, message: &std::ffi::CStr) -> PyResult<()> {
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyDeprecationWarning>(),
        message,
        1,
    )
}
