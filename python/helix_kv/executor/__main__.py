"""``python -m helix_kv.executor``: a Helix run of a checkpoint (:mod:`helix_kv.executor.cli`)."""

import sys

from helix_kv.executor.cli import main

sys.exit(main())
