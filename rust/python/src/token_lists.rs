//! A model runner's token lists as arrays, in one pass: vLLM's runner returns each step's
//! sampled tokens, and its drafter its proposals, as a Python list with one list of ints per
//! request, and an engine adapter hands them to the scheduler as numpy arrays without a
//! Python step per list (`helix_kv.integrations.vllm`).

use numpy::PyArray1;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyList, PyTuple};

use crate::arrays::int_arg;
use crate::errors::{invalid_type, InvalidArgumentError};

/// The error for a container that is neither a list nor a tuple.
fn not_a_list(obj: &Bound<'_, PyAny>, what: &str) -> PyErr {
    let type_name = obj
        .get_type()
        .name()
        .map_or_else(|_| "?".to_string(), |n| n.to_string());
    invalid_type(format!("{what} must be a list or a tuple, got {type_name}"))
}

/// Appends the tokens of row `i` (a list or a tuple of ints) to `tokens`.
fn push_row(row: &Bound<'_, PyAny>, i: usize, tokens: &mut Vec<i32>) -> PyResult<()> {
    if let Ok(list) = row.cast::<PyList>() {
        for (j, item) in list.iter().enumerate() {
            tokens.push(token(&item, i, j)?);
        }
    } else if let Ok(tuple) = row.cast::<PyTuple>() {
        for (j, item) in tuple.iter().enumerate() {
            tokens.push(token(&item, i, j)?);
        }
    } else {
        return Err(not_a_list(row, &format!("lists[{i}]")));
    }
    Ok(())
}

/// One token: an int (not a bool) or a numpy integer scalar that fits int32.
fn token(item: &Bound<'_, PyAny>, list: usize, position: usize) -> PyResult<i32> {
    let value: i64 = if item.is_exact_instance_of::<PyInt>() {
        item.extract()
            .map_err(|_| out_of_range(list, position, item))?
    } else if item.is_instance_of::<PyBool>() {
        return Err(invalid_type(format!(
            "lists[{list}][{position}] must be an integer, got a bool"
        )));
    } else {
        int_arg(
            item,
            &format!("lists[{list}][{position}]"),
            "-2**31..=2**31-1",
            InvalidArgumentError::new_err,
        )?
    };
    i32::try_from(value).map_err(|_| out_of_range(list, position, item))
}

fn out_of_range(list: usize, position: usize, item: &Bound<'_, PyAny>) -> PyErr {
    InvalidArgumentError::new_err(format!(
        "lists[{list}][{position}] must fit int32, got {item}"
    ))
}

/// The common form read without a reference count per item: a list of lists of exact
/// ints that fit int32 (what vLLM's runner returns, `tolist()` of a tensor). Returns false,
/// with `tokens` and `counts` partly filled, at the first thing of another form (the general
/// path then reads the whole of it again, with its errors).
fn flatten_exact(list: &Bound<'_, PyList>, tokens: &mut Vec<i32>, counts: &mut Vec<i64>) -> bool {
    counts.reserve(list.len());
    tokens.reserve(list.len());
    let list_type = std::ptr::addr_of_mut!(ffi::PyList_Type);
    let int_type = std::ptr::addr_of_mut!(ffi::PyLong_Type);
    // SAFETY: the GIL is held throughout and no Python code runs in this loop (no item's
    // method is called: only exact lists and ints are read, by the C API), so nothing can
    // change `list` or its rows while the borrowed references are read; every index is
    // below the length just read.
    unsafe {
        let outer = list.as_ptr();
        for i in 0..ffi::PyList_Size(outer) {
            let row = ffi::PyList_GetItem(outer, i);
            if row.is_null() || ffi::Py_TYPE(row) != list_type {
                ffi::PyErr_Clear();
                return false;
            }
            let len = ffi::PyList_Size(row);
            for j in 0..len {
                let item = ffi::PyList_GetItem(row, j);
                if item.is_null() || ffi::Py_TYPE(item) != int_type {
                    ffi::PyErr_Clear();
                    return false;
                }
                let value = ffi::PyLong_AsLong(item);
                if value == -1 && !ffi::PyErr_Occurred().is_null() {
                    ffi::PyErr_Clear();
                    return false;
                }
                match i32::try_from(value) {
                    Ok(token) => tokens.push(token),
                    Err(_) => return false,
                }
            }
            counts.push(i64::try_from(len).unwrap_or(i64::MAX));
        }
    }
    true
}

/// Flattened tokens (int32) and each list's length (int64).
type Flattened<'py> = (Bound<'py, PyArray1<i32>>, Bound<'py, PyArray1<i64>>);

/// `(tokens, counts)`: the tokens of `lists` one list after another (int32), and each
/// list's length (int64). `lists` is a list or tuple of lists or tuples of ints; a token
/// that is no integer (or a bool) is an `InvalidTypeError`, one that does not fit int32 an
/// `InvalidArgumentError`.
#[pyfunction]
pub fn flatten_token_lists<'py>(
    py: Python<'py>,
    lists: &Bound<'py, PyAny>,
) -> PyResult<Flattened<'py>> {
    let mut counts = Vec::new();
    let mut tokens = Vec::new();
    if let Ok(list) = lists.cast::<PyList>() {
        if flatten_exact(list, &mut tokens, &mut counts) {
            return Ok((
                PyArray1::from_vec(py, tokens),
                PyArray1::from_vec(py, counts),
            ));
        }
        tokens.clear();
        counts.clear();
    }
    let mut push = |i: usize, row: &Bound<'py, PyAny>| -> PyResult<()> {
        let before = tokens.len();
        push_row(row, i, &mut tokens)?;
        counts.push(i64::try_from(tokens.len() - before).unwrap_or(i64::MAX));
        Ok(())
    };
    if let Ok(list) = lists.cast::<PyList>() {
        for (i, row) in list.iter().enumerate() {
            push(i, &row)?;
        }
    } else if let Ok(tuple) = lists.cast::<PyTuple>() {
        for (i, row) in tuple.iter().enumerate() {
            push(i, &row)?;
        }
    } else {
        return Err(not_a_list(lists, "lists"));
    }
    Ok((
        PyArray1::from_vec(py, tokens),
        PyArray1::from_vec(py, counts),
    ))
}
