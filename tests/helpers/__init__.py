"""Helpers shared by the tests: the simulated executor over a ``SimulatedCPGroup``
(:mod:`.harness`), small scheduler builders (:mod:`.scheduler`), the keys of a run summary
(:mod:`.summary`), ``helix-kv simulate`` run in-process (:mod:`.cli`) and the process-group
runner of the multi-process tests (:mod:`.process_group`, which imports torch)."""

import os

#: Whether this run explores (``HELIX_KV_EXPLORE=1``: random draws, many more examples) rather
#: than gates (fixed draws); see ``tests/conftest.py``.
EXPLORING = os.environ.get("HELIX_KV_EXPLORE", "") not in ("", "0")


def examples(gate: int) -> int:
    """A property test's example count: ``gate`` when gating, twenty times it when exploring."""
    return gate * 20 if EXPLORING else gate
