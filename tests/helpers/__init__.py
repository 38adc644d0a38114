"""Helpers shared by the tests: the simulated executor over a ``SimulatedCPGroup``
(:mod:`.harness`), small scheduler builders (:mod:`.scheduler`), the keys of a run summary
(:mod:`.summary`) and the process-group runner of the multi-process tests
(:mod:`.process_group`, which imports torch)."""
