//! The simulator's pretend model, as kernels (`helix_kv.simulate.tokens` holds its
//! definition: the constants, the domains and which kernel makes which tokens). numpy took
//! several passes and a temporary array per operation for what is one pass here, and a
//! synthetic prompt of 12k tokens, or a step's sampled row per request, is made that way on
//! every step of a long sweep.

use numpy::PyArray1;
use pyo3::prelude::*;

use crate::arrays::{length_arg, try_capacity, u64_arg, u64_vec};
use crate::errors::InvalidArgumentError;

/// splitmix64's finalizer (wrapping arithmetic): the counter-based mix of every synthetic
/// token source.
#[inline]
fn mix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `vocab` as a token modulus: an integer in `1..=2**31`, so every token fits int32.
fn vocab_arg(vocab: &Bound<'_, PyAny>) -> PyResult<u64> {
    let vocab = u64_arg(vocab, "vocab")?;
    if (1..=1 << 31).contains(&vocab) {
        Ok(vocab)
    } else {
        Err(InvalidArgumentError::new_err(format!(
            "vocab must be in 1..=2**31, got {vocab}"
        )))
    }
}

#[expect(
    clippy::cast_possible_truncation,
    reason = "a value below vocab <= 2**31 fits int32 as a non-negative value"
)]
#[inline]
fn token(value: u64, vocab: u64) -> i32 {
    (value % vocab) as i32
}

/// splitmix64's finalizer of each value (uint64, wrapping), as a new array.
#[pyfunction]
pub fn splitmix64<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let mut values = u64_vec(values, "values", false)?;
    for value in &mut values {
        *value = mix(*value);
    }
    Ok(PyArray1::from_vec(py, values))
}

/// `length` tokens of blocks of `block_tokens`: token `j` is
/// `splitmix64(seeds[j // block_tokens] + j % block_tokens) % vocab` (int32); the seeds must
/// cover `length` tokens.
#[pyfunction]
pub fn mixed_tokens<'py>(
    py: Python<'py>,
    seeds: &Bound<'py, PyAny>,
    block_tokens: &Bound<'py, PyAny>,
    length: &Bound<'py, PyAny>,
    vocab: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let seeds = u64_vec(seeds, "seeds", false)?;
    let block_tokens = length_arg(block_tokens, "block_tokens")?;
    let length = length_arg(length, "length")?;
    let vocab = vocab_arg(vocab)?;
    if block_tokens == 0 {
        return Err(InvalidArgumentError::new_err("block_tokens must be >= 1"));
    }
    let covered = (seeds.len() as u64).saturating_mul(block_tokens);
    if length > covered {
        return Err(InvalidArgumentError::new_err(format!(
            "{} seeds of {block_tokens} tokens cannot make {length} tokens",
            seeds.len()
        )));
    }
    let (mut tokens, length) =
        try_capacity(usize::try_from(length).ok(), || format!("{length} tokens"))?;
    let block = usize::try_from(block_tokens).unwrap_or(usize::MAX);
    for &seed in &seeds {
        let take = block.min(length - tokens.len());
        tokens.extend((0..take as u64).map(|i| token(mix(seed.wrapping_add(i)), vocab)));
        if tokens.len() == length {
            break;
        }
    }
    Ok(PyArray1::from_vec(py, tokens))
}

/// `(request_ids % vocab) * id_multiplier + (output_indices + 1) * index_multiplier`, modulo
/// `vocab` (uint64 wrapping, then int32): the token each request samples as its
/// `output_indices`-th output.
#[pyfunction]
pub fn affine_tokens<'py>(
    py: Python<'py>,
    request_ids: &Bound<'py, PyAny>,
    output_indices: &Bound<'py, PyAny>,
    vocab: &Bound<'py, PyAny>,
    id_multiplier: &Bound<'py, PyAny>,
    index_multiplier: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let ids = u64_vec(request_ids, "request_ids", false)?;
    let indices = u64_vec(output_indices, "output_indices", false)?;
    let vocab = vocab_arg(vocab)?;
    let id_multiplier = u64_arg(id_multiplier, "id_multiplier")?;
    let index_multiplier = u64_arg(index_multiplier, "index_multiplier")?;
    if ids.len() != indices.len() {
        return Err(InvalidArgumentError::new_err(format!(
            "{} request ids but {} output indices",
            ids.len(),
            indices.len()
        )));
    }
    let tokens: Vec<i32> = ids
        .iter()
        .zip(&indices)
        .map(|(&id, &index)| {
            let mixed = (id % vocab)
                .wrapping_mul(id_multiplier)
                .wrapping_add(index.wrapping_add(1).wrapping_mul(index_multiplier));
            token(mixed, vocab)
        })
        .collect();
    Ok(PyArray1::from_vec(py, tokens))
}
