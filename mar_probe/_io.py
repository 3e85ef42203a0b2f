"""File input and output shared by every layer: reading weight files safely (tensors and plain containers only, a
message instead of a traceback), writing files atomically, and wording a failed write. Nothing here imports the
store's dependencies (zarr, xarray), so ``mar-probe train`` keeps its messages where only torch is installed (the
accelerator machine, issue 14).

Every loader of the toolkit (model checkpoints, the VAE, the classifier, the Inception network) reads through
:func:`load_weights`. ``torch.load(weights_only=True)`` refuses files that need code to load, but its message
advises retrying with ``weights_only=False``, which would run that code; a malicious checkpoint must never get
that advice (issue 19). A file that is no ``torch.save`` archive (random bytes, an empty or truncated file)
gets one line that says so.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import pickle
import re
from pathlib import Path

import torch

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def file_sha256(path) -> str:
    """SHA-256 of a file, streamed (a store's checkpoint, an averaged export's sources)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load_weights(path: str | Path, *, what: str, error: type[Exception], allowed: tuple = ()) -> object:
    """``torch.load(path, weights_only=True)`` with ``allowed`` extra globals, failures raised as ``error``.

    Parameters
    ----------
    path : str or Path
        An existing file.
    what : str
        What the file should be, for messages (e.g. ``"checkpoint"``, ``"VAE checkpoint"``).
    error : exception type
        Raised with a one-line message when the file cannot be read or is refused.
    allowed : tuple
        Classes that may be unpickled beside tensors and containers (e.g. ``argparse.Namespace``).
    """
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL.search(str(exc))
        if found:
            raise error(f"{what} {str(path)!r} is refused as untrusted: loading it would need code (it asks for "
                        f"the global {found.group(1)!r}); mar_probe loads tensors and plain containers only. "
                        f"Expected a {what} saved as a dict of tensors") from None
        raise error(f"{what} {str(path)!r} is not a PyTorch weights file (its bytes are no torch.save archive); "
                    f"expected a {what} written by torch.save") from None
    except (EOFError, RuntimeError, OSError, ValueError) as exc:
        reason = "the file is empty or truncated" if isinstance(exc, EOFError) or "truncat" in str(exc) else (
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'unreadable'}")
        raise error(f"{what} {str(path)!r} cannot be read: {reason}; expected a {what} written by torch.save") \
            from None


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``, on failure removed.

    A reader never sees a torn file: a full disk or a kill while writing leaves the old file (or none), never a
    truncated one (issue 19: a truncated ``grid.png``)."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def describe_os_error(exc: BaseException) -> str:
    """``Type: message``, with a hint when the disk is full."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        text += " (the disk is full: free space or choose another --out)"
    return text
