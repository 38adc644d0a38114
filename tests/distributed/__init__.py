"""Tests of :mod:`helix_kv.distributed`: in one process and over real process groups."""
