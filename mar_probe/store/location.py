"""Where a run store lives: a local folder or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

:class:`StoreLocation` is the one place that knows the difference (issue 16, item 2). Everything else opens zarr
through :meth:`StoreLocation.zarr_store` and lists, reads or removes files through its methods, so a local path
and an object-store URL take the same code paths.

Why two kinds of store under one name: on a local disk zarr's ``LocalStore`` writes each chunk to a temporary file
and renames it into place, so a killed writer leaves no torn chunk. Object stores have no rename, but each PUT is
atomic: an object appears whole or not at all. Either way a chunk is never seen half-written, so the writer's
order (data, then ``done``, then ``complete``) keeps a killed run consistent on both. Creating a store is the one
multi-object step that differs: locally it is built in a temporary folder and renamed into place; on an object
store it is built in place under a ``mar_probe_creating`` marker attribute that the last write replaces (see
:func:`mar_probe.store.writer.create_store`).

Credentials and endpoints come from the usual places of each filesystem (for S3: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` or ``~/.aws``), or from ``storage_options``.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

#: How long a remote store may take to answer its first request before it counts as unreachable.
CONNECT_TIMEOUT_S = 10.0


class StoreUnreachableError(ValueError):
    """The filesystem behind a store URL cannot be reached or refuses access (endpoint, credentials, bucket)."""


def is_url(path) -> bool:
    """True for ``proto://...`` strings other than ``file://`` (which is a local path)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


@dataclass(frozen=True)
class StoreLocation:
    """A run store's address. ``url`` is what the user gave (a local path as a string, or an fsspec URL).

    Build it with :meth:`of`; ``storage_options`` go to the fsspec filesystem of a URL.
    """
    url: str
    storage_options: dict = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, path, storage_options: dict | None = None) -> StoreLocation:
        """A location from a path, a URL or a location (returned as is)."""
        if isinstance(path, StoreLocation):
            return path
        if isinstance(path, str) and path.startswith("file://"):
            path = path[len("file://"):]
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"a run store is a path or an fsspec URL, got {type(path).__name__} {path!r}")
        return cls(str(path) if is_url(path) else os.fspath(path), dict(storage_options or {}))

    @property
    def is_local(self) -> bool:
        return not is_url(self.url)

    @property
    def local_path(self) -> Path:
        """The folder of a local store (a ValueError for a URL: callers that need a folder say so)."""
        if not self.is_local:
            raise ValueError(f"{self.url!r} is a remote store; this operation needs a local folder")
        return Path(self.url)

    def __str__(self) -> str:
        return self.url

    def __fspath__(self) -> str:  # a local location stands in for its folder
        return os.fspath(self.local_path)

    @property
    def fs(self):
        """The fsspec filesystem and the store's path in it (a local one for local stores)."""
        from fsspec.core import url_to_fs
        return url_to_fs(self.url, **self.storage_options)

    def zarr_store(self, *, read_only: bool = False):
        """A zarr v3 store object for :func:`zarr.open_group` and :func:`xarray.open_zarr`."""
        from zarr.storage import FsspecStore, LocalStore
        if self.is_local:
            return LocalStore(self.local_path, read_only=read_only)
        # an asynchronous filesystem instance of its own: zarr drives it from zarr's event loop, while the sync
        # instance of :attr:`fs` (listings, removal) belongs to fsspec's loop
        return FsspecStore.from_url(self.url, storage_options=self.storage_options, read_only=read_only)

    def exists(self) -> bool:
        """Whether anything is stored at the location (a remote one must answer: see :meth:`check_reachable`)."""
        if self.is_local:
            return self.local_path.exists()
        fs, path = self.fs
        fs.invalidate_cache(path)  # other processes write here: a cached listing would be stale
        return self._call(fs.exists, path + "/zarr.json") or bool(self._call(fs.ls, path, detail=False))

    def check_reachable(self) -> None:
        """Ask the filesystem once, within :data:`CONNECT_TIMEOUT_S`; raise :class:`StoreUnreachableError` if it
        cannot answer (no server at the endpoint, missing credentials, no such bucket)."""
        if not self.is_local:
            try:
                fs, path = self.fs
            except (ValueError, ImportError) as exc:  # an unknown protocol, or its package is not installed
                raise StoreUnreachableError(f"the store {self.url!r} cannot be opened: {exc} "
                                            f"({_endpoint_hint(self.url)})") from None
            parent = path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else path
            self._call(fs.ls, parent, detail=False)

    def _call(self, fn, *args, **kwargs):
        import concurrent.futures as cf
        pool = cf.ThreadPoolExecutor(1)
        try:
            return pool.submit(fn, *args, **kwargs).result(timeout=CONNECT_TIMEOUT_S)
        except FileNotFoundError:
            return False
        except cf.TimeoutError:
            raise StoreUnreachableError(f"the store {self.url!r} did not answer within {CONNECT_TIMEOUT_S:g} s; "
                                        f"check the endpoint ({_endpoint_hint(self.url)})") from None
        except Exception as exc:  # noqa: BLE001 - botocore, aiohttp and gcsfs raise many types
            raise StoreUnreachableError(f"the store {self.url!r} cannot be reached: {type(exc).__name__}: {exc} "
                                        f"({_endpoint_hint(self.url)})") from exc
        finally:
            pool.shutdown(wait=False)

    def remove(self) -> None:
        """Delete the store and everything under it."""
        if self.is_local:
            import shutil
            shutil.rmtree(self.local_path, ignore_errors=True)
            return
        fs, path = self.fs
        if fs.exists(path):
            fs.rm(path, recursive=True)

    def keys(self, prefix: str = "") -> set[str]:
        """The stored keys under ``prefix`` (e.g. a variable's name), relative to it: its chunk files."""
        if self.is_local:
            base = self.local_path / prefix
            out = set()
            for folder, _, files in os.walk(base):
                rel = Path(folder).relative_to(base)
                out.update(str(rel / f) if str(rel) != "." else f for f in files)
            return out
        fs, path = self.fs
        base = f"{path.rstrip('/')}/{prefix}".rstrip("/")
        fs.invalidate_cache(base)
        return {p[len(base) + 1:] for p in fs.find(base)} if fs.exists(base) else set()

    def read_text(self, key: str) -> str | None:
        """The text of the stored file ``key`` (e.g. ``"x/zarr.json"``), None when absent."""
        if self.is_local:
            p = self.local_path / key
            return p.read_text() if p.is_file() else None
        fs, path = self.fs
        try:
            return fs.cat_file(f"{path.rstrip('/')}/{key}").decode()
        except FileNotFoundError:
            return None

    def metadata_keys(self) -> list[str]:
        """``zarr.json`` of the root and of each array."""
        if self.is_local:
            root = self.local_path
            return [str(p.relative_to(root)) for p in [root / "zarr.json", *sorted(root.glob("*/zarr.json"))]]
        fs, path = self.fs
        base = path.rstrip("/")
        return ["zarr.json"] + sorted(p[len(base) + 1:] for p in fs.glob(f"{base}/*/zarr.json"))


def _endpoint_hint(url: str) -> str:
    if url.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        creds = "set" if os.environ.get("AWS_ACCESS_KEY_ID") else "not set in the environment"
        return f"endpoint {endpoint or 'AWS default'!r}, AWS_ACCESS_KEY_ID {creds}"
    return f"protocol {url.split('://', 1)[0]!r}"


def join(base, name: str) -> str:
    """``base/name`` for a folder or a URL (a URL keeps its ``proto://``)."""
    base = str(base)
    return f"{base.rstrip('/')}/{name}" if is_url(base) else os.fspath(Path(base) / name)


@contextmanager
def output_folder(out):
    """A local folder to write results into: ``out`` itself when local (the writer creates it), else a temporary
    folder whose files are uploaded to the URL ``out`` when the block ends without an error (figures, summaries,
    CSVs: small files that plotting and pandas write to local paths)."""
    loc = StoreLocation.of(out)
    if loc.is_local:  # not created here: a command refused before it writes leaves no folder (issue 19)
        yield loc.local_path
        return
    loc.check_reachable()
    with tempfile.TemporaryDirectory(prefix="mar-probe-out-") as tmp:
        yield Path(tmp)
        fs, path = loc.fs
        for file in sorted(Path(tmp).rglob("*")):
            if file.is_file():
                fs.put_file(str(file), f"{path.rstrip('/')}/{file.relative_to(tmp).as_posix()}")


def write_text(target, text: str) -> None:
    """Write ``text`` to a local file or a URL (one object, written whole)."""
    loc = StoreLocation.of(target)
    if loc.is_local:
        loc.local_path.write_text(text)
        return
    fs, path = loc.fs
    fs.pipe_file(path, text.encode())
