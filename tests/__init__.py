"""The conformance suite (installed inside the product as ``magi_moe.tests``)."""
