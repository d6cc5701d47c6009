"""The package version (one place: the root package, the CLI and the shared tier's client
name read it here)."""

__version__ = "0.1.0"
