"""Tests of :mod:`helix_kv.executor`, the reference executor (torch)."""
