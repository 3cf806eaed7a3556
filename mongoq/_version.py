"""The version of mongoq, in one place: the package's ``__init__``, the registry (which records
it with every primitive set up) and the build (``pyproject.toml`` reads it) all take it from
here. Imports nothing, so any module can import it. Owns no collections."""

__version__ = "0.1.0"
