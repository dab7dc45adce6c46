"""The fused kernels' tile tuner (``python -m tuner``): times each kernel's tile candidates on
a GPU, checks every candidate's output bit for bit, and writes the winners into the tile
tables the runtime reads (``magi_moe/kernels/tiles/fused.json``, through
:func:`magi_moe.kernels.tiles.write_tile_table`).

It lives outside the ``magi_moe`` package: the runtime only reads the tables, it never tunes,
and the wheel ships without this folder. It imports the product (the launch plan, the
launchers, the benchmark's cases and timer); nothing in the product imports it.

* :mod:`.candidates`: the tiles tried per kernel;
* :mod:`.sweep`: one case's candidates timed (:class:`~.sweep.CaseSweep`);
* :mod:`.choose`: the winners over cases and how they merge into a table;
* :mod:`.__main__`: the command line.
"""
