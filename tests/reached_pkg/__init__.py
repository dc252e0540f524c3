"""A package of the project's own whose submodule test_reached_code.py
reads through the package (``reached_pkg.inner.scale``)."""
