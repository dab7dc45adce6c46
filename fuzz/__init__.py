"""Property-based fuzzers for magi-moe's MoE implementations (installed as ``magi_moe.fuzz``).

* :mod:`fuzz.strategies` -- Hypothesis strategies for shapes, routing ties, skew and empty
  experts, values near the SwiGLU7 clamp, huge token counts; each takes strategies for its parts.
* :mod:`fuzz.properties` -- the checks (differential, tie rule, every implementation's routing,
  equivariance, linearity, empty experts, zero tokens, determinism, int64 offsets); every
  failure carries a one-line replay.
* :mod:`fuzz.fuzzers` -- the registry: one ``Property`` record per property (check, strategy,
  what it runs on, needs, settings), read by the tests, the campaign, ``list`` and ``replay``.
* :mod:`fuzz.huge` -- running a huge-token case in a child process.
* :mod:`fuzz.stateful` -- the weight-version-swap state machine for packed-weight caches.
* :mod:`fuzz.profiles` -- the ``ci`` / ``dev`` / ``nightly`` Hypothesis profiles.
* ``python -m fuzz`` -- the campaign runner (:mod:`fuzz.campaign`); ``python -m fuzz replay``.

The submodules are imported on demand: ``tests/conftest.py`` imports :mod:`fuzz.profiles` alone.
"""
