"""Tests of :mod:`helix_kv.simulate` (the ``helix-kv simulate`` command's parts)."""
