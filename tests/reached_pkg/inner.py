"""Read by test_reached_code.py as ``reached_pkg.inner.scale``."""
scale = 1.0
