"""helix_kv's Python tests. The tree mirrors ``python/helix_kv``: ``binding/`` tests the
``helix_kv._core`` edge (dtypes, conversions, error classes, pickling, the GIL),
``simulate/``, ``distributed/`` and ``executor/`` their subpackages, and the files here the
top-level modules. Scheduler rules are tested once, in Rust (``rust/core/tests``); shared
harnesses live in ``helpers/``.

Every test folder is a package, so test modules are imported by their full name
(``tests.simulate.test_cli``...) and two folders may hold files of the same name.
"""
