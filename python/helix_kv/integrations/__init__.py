"""helix_kv as the scheduler of serving engines.

- :mod:`helix_kv.integrations.vllm`: ``HelixScheduler``, vLLM 0.32's ``scheduler_cls``
  (``pip install 'helix_kv[vllm]'``; ``docs/vllm.md``).

Importing this package imports no engine: each integration imports its engine when it is
imported itself.
"""
