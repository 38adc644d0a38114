//! `helix_kv._core`: the thin `PyO3` layer over `helix_kv_core`. One file per area of the
//! Python surface; every class and exception is registered flat on `_core` and
//! re-exported by `helix_kv/__init__.py`.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::allow_attributes_without_reason,
    reason = "binding casts and allows are converted to per-site expects in a follow-up once the record rewrite lands"
)]

use pyo3::prelude::*;

mod arrays;
mod errors;
mod layout;
mod ledger;
mod request_output;
mod schedule_output;
mod scheduler;
mod scheduler_config;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    layout::register(m)?;
    ledger::register(m)?;
    scheduler::register(m)?;
    Ok(())
}
