"""Tests of the ``helix_kv._core`` binding edge: array dtypes and shapes, argument
conversions, one error class per core error, pickling, the GIL released around long calls.
The scheduler's rules themselves are tested in Rust (``rust/core/tests``)."""
