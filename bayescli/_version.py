"""The package version (floor 1: imported by files that record provenance, and by ``--version``)."""

__version__ = "0.1.0"
