"""The prefix cache's on-disk store (``--prefix-cache-dir DIR --prefix-cache-disk-gb N``): cached prompt pages (and
DeepSeek-V4's row-state snapshots) kept in files under DIR, named by their page key (``allocator.page_keys``, salted
with everything that changes the page's bytes), so a prefix evicted from memory, or served before a restart, is read
back instead of prefilled.

A file holds a list of arrays: ``MAGIC``, a little-endian u32 header length, the header (JSON: each array's dtype and
shape), the arrays' bytes, then the blake2b-16 digest of everything before it. It is written to a temporary name and
renamed into place (atomic: a reader never sees half a file). A file that is missing, truncated, of the wrong size,
fails its digest or does not hold the arrays the engine expects (``signature``) is a miss: reported in the log,
removed, and its prefix computed again. The directory is bounded by N GiB, the least recently used files out first
(a read renews a file's time). Host-only: files and NumPy arrays, never traced."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"ESSPFX01"
SUFFIXES = (".page", ".state")  # a page's arrays; the row state at its end


def signature(arrays: Sequence[np.ndarray]) -> list[tuple[str, tuple[int, ...]]]:
    """What a file must hold to be read back: each array's dtype and shape."""
    return [(np.dtype(a.dtype).str, tuple(a.shape)) for a in arrays]


def encode(arrays: Sequence[np.ndarray]) -> bytes:
    header = json.dumps([[dtype, list(shape)] for dtype, shape in signature(arrays)]).encode()
    body = MAGIC + struct.pack("<I", len(header)) + header + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return body + hashlib.blake2b(body, digest_size=16).digest()


def decode(data: bytes) -> list[np.ndarray]:
    """The arrays of a file's bytes; ValueError naming what is wrong with them."""
    if len(data) < len(MAGIC) + 4 + 16 or not data.startswith(MAGIC):
        raise ValueError(f"not a prefix-cache file ({len(data)} bytes, no header)")
    body, digest = data[:-16], data[-16:]
    if hashlib.blake2b(body, digest_size=16).digest() != digest:
        raise ValueError("its checksum does not match its bytes")
    (length,) = struct.unpack("<I", body[len(MAGIC):len(MAGIC) + 4])
    at = len(MAGIC) + 4 + length
    specs = json.loads(body[len(MAGIC) + 4:at])
    arrays = []
    for dtype, shape in specs:
        size = np.dtype(dtype).itemsize * int(np.prod(shape))
        if at + size > len(body):
            raise ValueError(f"it is truncated: {len(body) - at} bytes left for an array of {size}")
        arrays.append(np.frombuffer(body, dtype, int(np.prod(shape)), at).reshape(shape))
        at += size
    if at != len(body):
        raise ValueError(f"it has {len(body) - at} bytes past its arrays")
    return arrays


class PrefixStore:
    """Files under ``directory`` of at most ``max_bytes`` in all (the oldest out first)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int):
        if max_bytes <= 0:
            raise ValueError(f"--prefix-cache-disk-gb must be > 0, got a budget of {max_bytes} bytes")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        files = [p for p in self.directory.iterdir() if p.suffix in SUFFIXES]  # what an earlier run left
        files.sort(key=lambda p: p.stat().st_mtime)
        self._sizes: dict[str, int] = {p.name: p.stat().st_size for p in files}  # least recently used first

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def _name(self, key: bytes, suffix: str) -> str:
        return key.hex() + suffix

    def has(self, key: bytes, suffix: str = ".page") -> bool:
        return self._name(key, suffix) in self._sizes

    def get(self, key: bytes, suffix: str, expected: list[tuple[str, tuple[int, ...]]]) -> list[np.ndarray] | None:
        """The arrays stored under ``key`` (``suffix``: ".page" or ".state") if the file holds arrays of
        ``expected``'s dtypes and shapes; None (a miss) if it is absent or bad, a bad file reported and removed."""
        name = self._name(key, suffix)
        if name not in self._sizes:
            return None
        path = self.directory / name
        try:
            arrays = decode(path.read_bytes())
            if signature(arrays) != expected:
                raise ValueError(f"it holds arrays {signature(arrays)}, the engine reads {expected}")
        except (OSError, ValueError) as e:
            log.warning("prefix cache: %s is unreadable (%s); removed, its prefix is computed again", path, e)
            self._remove(name)
            return None
        self._sizes[name] = self._sizes.pop(name)  # the most recently used now
        os.utime(path)
        return arrays

    def put(self, key: bytes, suffix: str, arrays: Sequence[np.ndarray]) -> None:
        """Store ``arrays`` under ``key``, atomically; older files out while the directory would exceed its bound (a
        file larger than the whole bound is not stored)."""
        data = encode(arrays)
        name = self._name(key, suffix)
        if len(data) > self.max_bytes:
            return
        self._remove(name)
        while self._sizes and self.bytes + len(data) > self.max_bytes:
            self._remove(next(iter(self._sizes)))
        tmp = self.directory / f".{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.directory / name)
        self._sizes[name] = len(data)

    def _remove(self, name: str) -> None:
        if self._sizes.pop(name, None) is not None:
            (self.directory / name).unlink(missing_ok=True)


class PrefixDisk:
    """What an engine reads and writes in the store: a page's arrays (``page``: their dtypes and shapes, the decode
    cache's paged arrays at one page, then the MTP module's) and, for a family with row state, the row-state
    snapshot at a page's end (``state``: its pytree structure, and its leaves' dtypes and shapes; None: none)."""

    def __init__(self, store: PrefixStore, page: list, state: tuple | None):
        self.store, self.page, self.state_spec = store, page, state

    def pages(self, keys: Sequence[bytes]) -> list[list[np.ndarray]]:
        """The arrays of the longest run of ``keys`` whose pages read back (stops at the first absent or bad one)."""
        out = []
        for key in keys:
            if (arrays := self.store.get(key, ".page", self.page)) is None:
                break
            out.append(arrays)
        return out

    def has(self, key: bytes, suffix: str = ".page") -> bool:
        return self.store.has(key, suffix)

    def state(self, key: bytes) -> tuple | None:
        """The row state kept at the end of page ``key`` (a pytree of arrays) and its bytes, or None."""
        treedef, spec = self.state_spec
        leaves = self.store.get(key, ".state", spec)
        return None if leaves is None else (jax.tree.unflatten(treedef, leaves), sum(x.nbytes for x in leaves))

    def save_page(self, key: bytes, arrays: list[np.ndarray]) -> None:
        self.store.put(key, ".page", arrays)

    def save_state(self, key: bytes, state) -> None:
        self.store.put(key, ".state", jax.tree.leaves(state))
