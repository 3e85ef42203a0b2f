"""The zarr store of a recorded run: schema, writer and the lazy xarray reader."""
from .reader import IncompleteRunWarning, SchemaError, open_run, read_attrs
from .schema import SCHEMA_VERSION, estimate_size, format_bytes, resolve

__all__ = ["SCHEMA_VERSION", "IncompleteRunWarning", "SchemaError", "estimate_size", "format_bytes", "open_run",
           "read_attrs", "resolve"]
