"""Hypothesis profiles: the test suite is a gate that fails only on a change, never on the draw.

``gate`` (the default, what CI runs): every property test draws the same examples on every run
(``derandomize``: seeded from the test itself) and keeps no example database, so a clean clone
and a developer's checkout test the same cases. ``explore`` (``HELIX_KV_EXPLORE=1``, the
command in ``docs/internals/testing.md``): random draws and twenty times the examples
(:func:`tests.helpers.examples`), with the example database on, so a failure it finds replays;
turn what it finds into a regression test (an ``@example`` or a rule test) and commit it.
"""

from hypothesis import settings

from tests.helpers import EXPLORING

settings.register_profile("gate", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("explore" if EXPLORING else "gate")
