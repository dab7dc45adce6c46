"""The benchmark and the fused kernels' tile sweep: ``python -m magi_moe.bench --help``.

``cases`` (the problems and their floors), ``paths`` (what is timed), ``timing`` (how),
``sweep`` (the tile sweep and the per-launch breakdown), ``__main__`` (the command line).
``python -m magi_moe.benchmark`` is the same command under its older name."""
