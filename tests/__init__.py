"""The conformance suite (installed as ``magi_moe.tests``)."""
if __name__ in ("audit", "fuzz", "tests"):  # the checkout's top-level name: an alias
    from magi_moe.suite_names import alias_top_level

    alias_top_level(__name__)
