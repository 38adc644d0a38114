//! `helix_kv._core`: the thin `PyO3` layer over `helix_kv_core`. One file per area of the
//! Python surface; every class and exception is registered flat on `_core` and
//! re-exported by `helix_kv/__init__.py`.

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
