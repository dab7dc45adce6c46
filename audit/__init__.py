"""magi-moe's auditors: proven error bounds, weight-cache rules, determinism, discipline, and
the backend self-check, run together by ``python -m audit`` (see :mod:`audit.report`)."""
