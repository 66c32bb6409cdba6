"""The prefix cache's on-disk store (``--prefix-cache-dir DIR --prefix-cache-disk-gb N``): cached prompt pages (and
DeepSeek-V4's row-state snapshots) kept in files under ``DIR/SUBDIR``, named by their page key
(``allocator.page_keys``, chained from a salt naming everything that changes the page's bytes: the weights'
fingerprint, ``weights_fingerprint``, among them), so a prefix evicted from memory, or served before a restart, is
read back instead of prefilled.

A file holds a list of arrays: ``MAGIC``, a little-endian u32 header length, the header (JSON: the page key and the
store's salt it was written under, each array's dtype and shape), the arrays' bytes, then the blake2b-16 digest of
everything before it. A file that is missing, of another size than listed, not a regular file, truncated, fails its
digest, names another key or salt, or does not hold the arrays the engine expects (``signature``) is a miss: reported
in the log, dropped, and its prefix computed again.

The store is the subdirectory's only writer: it holds an exclusive lock on ``SUBDIR/lock`` for its process's life;
a second process on the same directory reads the files and writes none (logged). Files are written by a background
thread from a bounded queue (a page past a full queue is dropped and counted): to a temporary file (``O_EXCL``,
``O_NOFOLLOW``, mode 0600), fsynced, then renamed over the old copy; temporaries an earlier run left are removed at
start. Files are opened ``O_NOFOLLOW | O_NONBLOCK`` and read only when they are regular files of the listed size, so a
symlink, a FIFO or a device is never followed. The first I/O error (a full disk, the directory removed) is logged and
turns the store off: the engine serves on from memory. The directory is bounded by N GiB, the least recently used
files out first (a read renews a file's time; the pages of one prompt are written and renewed tail first, so eviction
takes a prefix's last pages before its first). Host-only: files and NumPy arrays, never traced."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import queue
import re
import stat
import struct
import threading
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"ESSPFX02"
SUBDIR = "ess_jax-prefix-cache"  # the store's own subdirectory of --prefix-cache-dir
FORMAT = "ess_jax prefix cache, format 2\n"  # SUBDIR/FORMAT: a directory of another format is refused
SUFFIXES = (".page", ".state")  # a page's arrays; the row state at its end
FILE_NAME = re.compile(r"[0-9a-f]{32}\.(page|state)")
TEMP_NAME = re.compile(r"\..+\.tmp")
QUEUE = 256  # files waiting for the background writer; more are dropped
_LOCKS: dict[str, int] = {}  # subdirectory (real path) -> this process's locked file descriptor, held for its life


def weights_fingerprint(name: str, params) -> bytes:
    """A digest of what names a model's weights: for a checkpoint directory (``config.resolve_model``) its real path
    and every ``*.safetensors`` / ``*.json`` file's name, size, modification time and (safetensors) header; for anything
    else (a preset of random weights from a seed, a model built in code) the parameters' bytes; and the ess_jax
    version. Another checkpoint, one saved over in place, or another seed names other pages."""
    from ess_jax.config import ConfigError, resolve_model
    digest = hashlib.blake2b(digest_size=16)
    try:
        version = importlib.metadata.version("ess_jax")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    digest.update(f"ess_jax {version}\n".encode())
    try:
        directory = resolve_model(name).checkpoint
    except ConfigError:
        directory = None
    if directory is not None:
        directory = Path(directory).resolve()
        digest.update(f"{directory}\n".encode())
        for path in sorted(p for p in directory.iterdir() if p.suffix in (".safetensors", ".json")):
            info = path.stat()
            digest.update(f"{path.name} {info.st_size} {info.st_mtime_ns}\n".encode())
            if path.suffix == ".safetensors":
                with path.open("rb") as f:
                    (length,) = struct.unpack("<Q", f.read(8))
                    digest.update(f.read(min(length, 100 << 20)))
        return digest.digest()
    for leaf in jax.tree.leaves(params):  # no files name them: their values do
        data = jax.device_get(leaf) if leaf.is_fully_addressable else leaf.addressable_shards[0].data
        digest.update(np.ascontiguousarray(np.asarray(data)).view(np.uint8).reshape(-1))
    return digest.digest()


def signature(arrays: Sequence[np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    """What a file must hold to be read back: each array's dtype and shape."""
    return [(np.dtype(a.dtype).str, tuple(a.shape)) for a in arrays]


def encode(arrays: Sequence[np.ndarray], key: bytes, salt: bytes) -> bytes:
    """A file's bytes: ``arrays`` stored under page ``key`` by a store of ``salt``."""
    specs = [[dtype, list(shape)] for dtype, shape in signature(arrays)]
    header = json.dumps({"key": key.hex(), "salt": salt.hex(), "arrays": specs}).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return body + hashlib.blake2b(body, digest_size=16).digest()


def decode(data: bytes, key: bytes, salt: bytes) -> list[np.ndarray]:
    """The arrays of a file's bytes written under ``key`` by a store of ``salt``; ValueError naming what is wrong."""
    if len(data) < len(MAGIC) + 4 + 16 or not data.startswith(MAGIC):
        raise ValueError(f"not a prefix-cache file ({len(data)} bytes, no header)")
    body, digest = data[:-16], data[-16:]
    if hashlib.blake2b(body, digest_size=16).digest() != digest:
        raise ValueError("its checksum does not match its bytes")
    (length,) = struct.unpack("<I", body[len(MAGIC):len(MAGIC) + 4])
    at = len(MAGIC) + 4 + length
    try:
        header = json.loads(body[len(MAGIC) + 4:at])
        stored_key, stored_salt, specs = header["key"], header["salt"], header["arrays"]
        specs = [(np.dtype(dtype), tuple(int(n) for n in shape)) for dtype, shape in specs]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"its header is not one this store writes ({e})") from None
    if stored_key != key.hex():
        raise ValueError(f"it holds page {stored_key}, not {key.hex()}")
    if stored_salt != salt.hex():
        raise ValueError(f"it was written for another model or cache (salt {stored_salt}, this engine's {salt.hex()})")
    arrays = []
    for dtype, shape in specs:
        if dtype.hasobject or min(shape, default=0) < 0:
            raise ValueError(f"it holds an array of {dtype} {shape}, not one of numbers")
        count = int(np.prod(shape))
        size = dtype.itemsize * count
        if at + size > len(body):
            raise ValueError(f"it is truncated: {len(body) - at} bytes left for an array of {size}")
        arrays.append(np.frombuffer(body, dtype, count, at).reshape(shape))
        at += size
    if at != len(body):
        raise ValueError(f"it has {len(body) - at} bytes past its arrays")
    return arrays


class PrefixStore:
    """Files under ``directory/SUBDIR`` of at most ``max_bytes`` in all (the least recently used out first), each
    carrying its key and ``salt``. ``enabled``: False once an I/O error turned it off; ``writable``: False when another
    process holds the directory (this one only reads); ``dropped``: files not written because the queue was full."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, salt: bytes):
        if max_bytes <= 0:
            raise ValueError(f"--prefix-cache-disk-gb must be > 0, got a budget of {max_bytes} bytes")
        self.directory = Path(directory) / SUBDIR
        self.max_bytes, self.salt = max_bytes, salt
        self.enabled, self.writable, self.dropped = True, True, 0
        self._sizes: dict[str, int] = {}  # file -> bytes, least recently used first
        self._queued: set[str] = set()  # files waiting for the writer
        self._lock = threading.Lock()  # over _sizes, _queued and the files
        self._queue: queue.Queue = queue.Queue(QUEUE)
        self._temps = 0
        try:
            self._open()
        except OSError as e:
            self._fail("opening it", e)
        self._writer = None
        if self.enabled and self.writable:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-store-writer", daemon=True)
            self._writer.start()

    def _open(self) -> None:
        """Make or check the subdirectory (0700, no symlink, of this format), take its lock (else read only), remove
        stale temporaries, list the files an earlier run left (oldest first)."""
        parent = self.directory.parent
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.mkdir(self.directory, 0o700)
            fd = os.open(self.directory / "FORMAT", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(FORMAT)
        except FileExistsError:
            pass
        info = os.lstat(self.directory)
        if not stat.S_ISDIR(info.st_mode):
            raise OSError(f"{self.directory} is not a directory (a symlink?); remove it")
        if info.st_uid != os.getuid():
            raise OSError(f"{self.directory} belongs to another user (uid {info.st_uid}); use a directory of your own")
        os.chmod(self.directory, 0o700)
        fd = os.open(self.directory / "FORMAT", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            found = f.read(len(FORMAT) + 1)
        if found != FORMAT.encode():
            raise OSError(f"{self.directory / 'FORMAT'} names another format ({found[:60]!r}); remove the directory")
        real = os.path.realpath(self.directory)
        if real not in _LOCKS:
            fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _LOCKS[real] = fd
            except BlockingIOError:
                os.close(fd)
                self.writable = False
                log.warning("prefix cache: another process writes the disk store %s; this one only reads it (give "
                            "each server its own --prefix-cache-dir for both to write)", self.directory)
        files = []
        for entry in os.scandir(self.directory):
            if self.writable and TEMP_NAME.fullmatch(entry.name):  # a write an earlier run did not finish
                try:
                    os.unlink(entry.path)
                except OSError as e:
                    log.warning("prefix cache: cannot remove the stale temporary %s (%s)", entry.path, e)
            elif FILE_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                files.append((info.st_mtime_ns, entry.name, info.st_size))
        self._sizes = {name: size for _, name, size in sorted(files)}

    def _fail(self, what: str, error: Exception) -> None:
        """The first I/O error turns the store off, logged once; the engine serves on without it."""
        if self.enabled:
            self.enabled = False
            log.error("prefix cache: the disk store %s failed %s (%s); it is off, the engine serves on without it",
                      self.directory, what, error)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    @staticmethod
    def _name(key: bytes, suffix: str) -> str:
        return key.hex() + suffix

    def has(self, key: bytes, suffix: str = ".page") -> bool:
        """The store holds (or is writing) ``key``'s file."""
        name = self._name(key, suffix)
        with self._lock:
            return self.enabled and (name in self._sizes or name in self._queued)

    def get(self, key: bytes, suffix: str, expected: list[tuple[str, tuple[int, ...]]]) -> list[np.ndarray] | None:
        """The arrays stored under ``key`` (``suffix``: ".page" or ".state") if the file holds arrays of
        ``expected``'s dtypes and shapes; None (a miss) if it is absent or bad, a bad file reported and dropped."""
        name = self._name(key, suffix)
        with self._lock:
            if not self.enabled or (size := self._sizes.get(name)) is None:
                return None
            path = self.directory / name
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                try:
                    info = os.fstat(fd)
                    if not stat.S_ISREG(info.st_mode):
                        raise ValueError("it is not a regular file")
                    if info.st_size != size:
                        raise ValueError(f"it has {info.st_size} bytes, {size} were written")
                    chunks, left = [], size + 1  # one byte past the size: a file that grew is caught by decode
                    while left and (chunk := os.read(fd, min(left, 1 << 30))):
                        chunks.append(chunk)
                        left -= len(chunk)
                    data = b"".join(chunks)
                finally:
                    os.close(fd)
                arrays = decode(data, key, self.salt)
                if signature(arrays) != expected:
                    raise ValueError(f"it holds arrays {signature(arrays)}, the engine reads {expected}")
            except FileNotFoundError:
                del self._sizes[name]  # gone (another engine of this process evicted it): a plain miss
                return None
            except (OSError, ValueError) as e:
                log.warning("prefix cache: %s is unreadable (%s); dropped, its prefix is computed again", path, e)
                self._drop(name)
                return None
            self._sizes[name] = self._sizes.pop(name)  # the most recently used now
            if self.writable:
                try:
                    os.utime(path, follow_symlinks=False)
                except OSError as e:
                    self._fail(f"renewing {name}", e)
            return arrays

    def put(self, key: bytes, suffix: str, arrays: Sequence[np.ndarray]) -> None:
        """Queue ``arrays`` to be stored under ``key`` (dropped and counted when the queue is full)."""
        name = self._name(key, suffix)
        with self._lock:
            if not (self.enabled and self.writable) or name in self._queued:
                return
            try:
                self._queue.put_nowait((key, name, [np.asarray(a) for a in arrays]))
            except queue.Full:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("prefix cache: the disk store's writer is behind (%d files queued); pages past that "
                                "are not stored (counted in its dropped files)", QUEUE)
                return
            self._queued.add(name)

    def flush(self) -> None:
        """Wait until every queued file is written."""
        if self._writer is not None:
            self._queue.join()

    def _write_loop(self) -> None:
        while True:
            key, name, arrays = self._queue.get()
            try:
                self._write(key, name, arrays)
            except OSError as e:
                with self._lock:
                    self._fail(f"writing {name}", e)
            finally:
                with self._lock:
                    self._queued.discard(name)
                self._queue.task_done()

    def _write(self, key: bytes, name: str, arrays: list[np.ndarray]) -> None:
        """Store a file atomically: older files out while the directory would exceed its bound (a file larger than
        the whole bound is not stored), written to a temporary file, fsynced, renamed over the old copy."""
        data = encode(arrays, key, self.salt)
        if len(data) > self.max_bytes or not self.enabled:
            return
        with self._lock:
            while self._sizes and sum(self._sizes.values()) - self._sizes.get(name, 0) + len(data) > self.max_bytes:
                oldest = next(iter(self._sizes))
                if oldest == name:
                    self._sizes[name] = self._sizes.pop(name)
                    continue
                self._drop(oldest)
            self._temps += 1
            tmp = self.directory / f".{name}.{os.getpid()}.{self._temps}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        with self._lock:
            os.replace(tmp, self.directory / name)
            self._sizes.pop(name, None)
            self._sizes[name] = len(data)
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _drop(self, name: str) -> None:
        """Forget a file (under the lock); removed when this store writes the directory."""
        if self._sizes.pop(name, None) is not None and self.writable:
            try:
                (self.directory / name).unlink(missing_ok=True)
            except IsADirectoryError:
                pass
            except OSError as e:
                self._fail(f"removing {name}", e)


class PrefixDisk:
    """What an engine reads and writes in the store: a page's arrays (``page``: their dtypes and shapes, the decode
    cache's paged arrays at one page, then the MTP module's) and, for a family with row state, the row-state
    snapshot at a page's end (``state``: its pytree structure, and its leaves' dtypes and shapes; None: none)."""

    def __init__(self, store: PrefixStore, page: list, state: tuple | None):
        self.store, self.page, self.state_spec = store, page, state

    def pages(self, keys: Sequence[bytes]) -> list[list[np.ndarray]]:
        """The arrays of the longest run of ``keys`` whose pages read back (stops at the first absent or bad one),
        read tail first (the run's first page is the most recently used)."""
        run = next((i for i, key in enumerate(keys) if not self.store.has(key)), len(keys))
        out = []
        for key in reversed(keys[:run]):
            if (arrays := self.store.get(key, ".page", self.page)) is None:
                out = []  # a bad page ends the run before it
                continue
            out.append(arrays)
        return out[::-1]

    def has(self, key: bytes, suffix: str = ".page") -> bool:
        return self.store.has(key, suffix)

    def state(self, key: bytes) -> tuple | None:
        """The row state kept at the end of page ``key`` (a pytree of arrays) and its bytes, or None."""
        treedef, spec = self.state_spec
        leaves = self.store.get(key, ".state", spec)
        return None if leaves is None else (jax.tree.unflatten(treedef, leaves), sum(x.nbytes for x in leaves))

    def save_pages(self, keys: Sequence[bytes], pages: Sequence[list[np.ndarray]]) -> None:
        """Store the pages of one prompt (``keys`` in token order), tail first."""
        for key, arrays in reversed(list(zip(keys, pages))):
            self.store.put(key, ".page", arrays)

    def save_state(self, key: bytes, state) -> None:
        self.store.put(key, ".state", jax.tree.leaves(state))
