//! `Layout`: the Helix token placement, scalar and batch (numpy) forms.
// PyO3 methods receive `&self`; the class is a small `Copy` value, so the lint does not apply.
#![allow(clippy::trivially_copy_pass_by_ref)]

use helix_kv_core::Layout;
use numpy::{PyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::arrays::{int64_array, length, non_negative};
use crate::errors::IntoPyResult;

/// Token placement for `cp` ranks with pages of `tokens_per_block` tokens.
#[pyclass(frozen, eq, hash, module = "helix_kv._core", name = "Layout")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PyLayout {
    pub inner: Layout,
}

#[pymethods]
impl PyLayout {
    #[new]
    #[pyo3(signature = (cp, tokens_per_block))]
    fn new(cp: u32, tokens_per_block: u32) -> PyResult<Self> {
        Ok(Self {
            inner: Layout::new(cp, tokens_per_block).py()?,
        })
    }

    /// Ranks in the CP group.
    #[getter]
    fn cp(&self) -> u32 {
        self.inner.cp()
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
    fn owner_rank(&self, pos: i64) -> PyResult<u32> {
        Ok(self.inner.owner_rank(length(pos, "position")?))
    }

    /// Tokens of a length-`n` sequence held by `rank`.
    fn local_len(&self, n: i64, rank: u32) -> PyResult<u64> {
        self.inner.check_rank(rank).py()?;
        Ok(self.inner.local_len(length(n, "length")?, rank))
    }

    /// Superblocks a length-`n` sequence needs: `ceil(n / (tokens_per_block * cp))`.
    fn superblocks_for(&self, n: i64) -> PyResult<u64> {
        Ok(self.inner.superblocks_for(length(n, "length")?))
    }

    /// Index of global position `pos` inside its owner's local sequence.
    fn local_index(&self, pos: i64) -> PyResult<u64> {
        Ok(self.inner.local_index(length(pos, "position")?))
    }

    /// Global position of the `local_index`-th token held by `rank`.
    fn global_position(&self, rank: u32, local_index: i64) -> PyResult<u64> {
        self.inner.check_rank(rank).py()?;
        Ok(self
            .inner
            .global_position(rank, length(local_index, "local index")?))
    }

    /// Batch `owner_rank` (int32 out).
    fn owner_ranks<'py>(
        &self,
        positions: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let layout = self.inner;
        map_array(positions, "positions", |p| layout.owner_rank(p) as i32)
    }

    /// Batch `local_len` for one rank (int64 out).
    fn local_lens<'py>(
        &self,
        lengths: &Bound<'py, PyAny>,
        rank: u32,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        self.inner.check_rank(rank).py()?;
        let layout = self.inner;
        map_array(lengths, "lengths", |n| layout.local_len(n, rank) as i64)
    }

    /// Batch `superblocks_for` (int64 out).
    fn superblocks_for_many<'py>(
        &self,
        lengths: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let layout = self.inner;
        map_array(lengths, "lengths", |n| layout.superblocks_for(n) as i64)
    }

    /// Batch `global_position` for one rank (int64 out).
    fn global_positions<'py>(
        &self,
        rank: u32,
        local_indices: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        self.inner.check_rank(rank).py()?;
        let layout = self.inner;
        map_array(local_indices, "local indices", |i| {
            layout.global_position(rank, i) as i64
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Layout(cp={}, tokens_per_block={})",
            self.inner.cp(),
            self.inner.tokens_per_block()
        )
    }
}

/// Applies `f` to every element of a non-negative int64 array-like.
fn map_array<'py, T: numpy::Element + Send>(
    values: &Bound<'py, PyAny>,
    what: &str,
    f: impl Fn(u64) -> T + Send + Sync,
) -> PyResult<Bound<'py, PyArray1<T>>> {
    let array = int64_array(values)?;
    let slice = array.as_slice()?;
    if let Some(&bad) = slice.iter().find(|&&v| v < 0) {
        non_negative(&[bad], what, true)?;
    }
    let out: Vec<T> = slice.iter().map(|&v| f(v as u64)).collect();
    debug_assert_eq!(out.len(), array.len());
    Ok(PyArray1::from_vec(values.py(), out))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLayout>()
}
