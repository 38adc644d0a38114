"""``python -m helix_kv``: the ``helix-kv`` command (see :mod:`helix_kv.cli`)."""

import sys

from helix_kv.cli import main

sys.exit(main())
