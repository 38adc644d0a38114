//! `helix_kv._core`: the thin `PyO3` layer over `helix_kv_core`. One file per area of the
//! Python surface; the module below is the one export list: every class and exception is
//! registered flat on `_core` and re-exported by `helix_kv/__init__.py`.

#[macro_use]
mod records;

mod arrays;
mod errors;
mod layout;
mod ledger;
mod rank_group;
mod request_output;
mod schedule_output;
mod scheduler;
mod scheduler_config;
mod simulate_tokens;
mod step_metadata;

#[pyo3::pymodule]
mod _core {
    use pyo3::prelude::*;

    #[pymodule_export]
    use crate::errors::{
        DeadlockError, DuplicateRequestError, HelixKVError, InvalidArgumentError,
        InvalidLengthError, InvalidStateError, PreemptionDisabledError, RequestTooLargeError,
        UnknownRequestError,
    };
    #[pymodule_export]
    use crate::layout::PyLayout;
    #[pymodule_export]
    use crate::ledger::{PyDecodeView, PyLedger, PyRequestHoldings};
    #[pymodule_export]
    use crate::rank_group::{add_request_ranks, schedule_ranks, update_ranks};
    #[pymodule_export]
    use crate::records::{PyRequestMetrics, PySchedulerMetrics};
    #[pymodule_export]
    use crate::request_output::PyRequestOutput;
    #[pymodule_export]
    use crate::schedule_output::PyScheduleOutput;
    #[pymodule_export]
    use crate::scheduler::PyScheduler;
    #[pymodule_export]
    use crate::scheduler_config::{PyConfigField, PySchedulerConfig};
    #[pymodule_export]
    use crate::simulate_tokens::{affine_tokens, mixed_tokens, splitmix64};
    #[pymodule_export]
    use crate::step_metadata::{PyDecodeRowCounts, PyStepMetadata, PyStepMetadataLayout};

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add(
            "DECODE_ROW_COLUMNS",
            pyo3::types::PyTuple::new(m.py(), crate::step_metadata::decode_row_columns())?,
        )?;
        m.add(
            "DECODE_ROW_PADDING",
            pyo3::types::PyTuple::new(m.py(), helix_kv_core::decode_row::PADDING)?,
        )?;
        crate::errors::add_run_time_errors(m)
    }
}
