"""The zarr store of a recorded run: schema, writer and the lazy xarray reader."""
from .integrity import IntegrityReport, mark_for_repair, missing_chunks, verify
from .reader import DamagedRunWarning, IncompleteRunWarning, SchemaError, open_run, read_attrs
from .schema import SCHEMA_VERSION, estimate_size, format_bytes, resolve

__all__ = ["SCHEMA_VERSION", "DamagedRunWarning", "IncompleteRunWarning", "IntegrityReport", "SchemaError",
           "estimate_size", "format_bytes", "mark_for_repair", "missing_chunks", "open_run", "read_attrs", "resolve",
           "verify"]

