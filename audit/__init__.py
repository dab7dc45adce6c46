"""magi-moe's auditors: weight-cache rules, determinism, discipline, CUDA graphs, row isolation
and the backend self-check, run together by ``magi-moe audit`` / ``python -m magi_moe.audit``
(see :mod:`magi_moe.audit.report`). Installed inside the product as ``magi_moe.audit``; the
accuracy judge they all apply is the product's own (:mod:`magi_moe.judge`).
"""
