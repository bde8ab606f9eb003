"""Worked examples of commfuse in real programs.

- :mod:`commfuse.examples.train_block`: trains a small transformer block with
  tensor + sequence parallelism over ``tp`` and ZeRO-style data parallelism
  over ``dp``, fused (commfuse) against an unfused ``jax.lax`` twin. Run it as
  ``python -m commfuse.examples.train_block``. It needs the ``examples`` extra
  (``pip install ".[examples]"``: optax and equinox).
"""
