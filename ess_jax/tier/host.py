"""The tier's host stores: every offloaded row of every admitted request, ``[L, G, Z, W]`` (the entries'
pages), behind one contract with two backends (DESIGN.md §5), tested for identical results.

- ``PinnedHostStore`` (``--fetch inline``): a jax array in pinned host memory. ``fetch`` gathers the rows
  on the host under ``compute_on("device_host")`` and transfers them inside the step; ``backup`` and
  ``store_prompt`` scatter on the host side, ``load`` (a cached prefix's whole pages) gathers there. One compiled
  step, no host round trip.
- ``NumpyHostStore`` (``--fetch split``): a NumPy array. ``fetch`` is a host callback at the fetch point
  (one batched transfer per layer); ``backup``, ``store_prompt`` and ``load`` are ordered io callbacks. Portable.

A page of a cached prompt prefix is shared by every request whose prompt starts with it (the engine's page
ids are the host store's): written once by the request that prefilled it, then only read.

On a mesh the steps run per data shard (``ess_jax.mesh.per_shard``) with page ids local to the shard: the
pinned store is sharded over ``data`` on its page axis (each shard's pages in its own devices' host memory);
the NumPy store maps a shard's pages to its part of the array, its callbacks run where every mesh axis is
manual (``mesh.all_manual``).

Every method is called inside a traced step and returns the (possibly new) store.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import io_callback
from jax.experimental.compute_on import compute_on

from ess_jax import mesh

FETCH_BACKENDS = ("inline", "split")

_ON_HOST = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)


class PinnedHostStore:
    """``--fetch inline``: the rows in a pinned-host jax array."""

    def __init__(self, array: jax.Array):
        self.array = array  # [L, G, Z, W] in pinned host memory

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype) -> PinnedHostStore:
        # zeros computed on the host side: the store never passes through device memory
        return cls(jax.jit(_ON_HOST(lambda: jnp.zeros(shape, dtype)))())

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def rows(self) -> np.ndarray:
        """Every row, on the host (tests, figures)."""
        return np.asarray(self.array)

    def fetch(self, layer, page_BK: jax.Array, offset_BK: jax.Array) -> jax.Array:
        """Rows of layer ``layer`` (an int or i32[], traced inside a scan over layers) at (page, offset)
        ``[B, K, W]`` on the device."""
        # every operand of a host computation must live in host memory, the layer index included
        index = jax.device_put((jnp.full_like(page_BK, layer), page_BK, offset_BK), jax.memory.Space.Host)
        rows = _ON_HOST(lambda store, l, p, o: store[l, p, o])(self.array, *index)
        return jax.device_put(rows, jax.memory.Space.Device)

    def backup(self, page_B: jax.Array, offset_B: jax.Array, rows_LBW: jax.Array) -> PinnedHostStore:
        """Every layer's row of each batch row at (page, offset)."""
        operands = jax.device_put((page_B, offset_B, rows_LBW), jax.memory.Space.Host)
        return PinnedHostStore(_ON_HOST(lambda store, p, o, rows: store.at[:, p, o].set(rows))(self.array, *operands))

    def store_prompt(self, rows_LXZW: jax.Array, pages_X: jax.Array) -> PinnedHostStore:
        """Whole pages of rows at ``pages_X``."""
        operands = jax.device_put((rows_LXZW, pages_X), jax.memory.Space.Host)
        return PinnedHostStore(_ON_HOST(lambda store, r, p: store.at[:, p].set(r))(self.array, *operands))

    def load(self, pages_X: jax.Array) -> jax.Array:
        """Whole pages ``pages_X`` of rows on the device ``[L, X, Z, W]``, gathered on the host side."""
        rows = _ON_HOST(lambda store, p: store[:, p])(self.array, jax.device_put(pages_X, jax.memory.Space.Host))
        return jax.device_put(rows, jax.memory.Space.Device)


jax.tree_util.register_pytree_node(PinnedHostStore, lambda s: ((s.array,), None),
                                   lambda _, children: PinnedHostStore(*children))


class NumpyHostStore:
    """``--fetch split``: the rows in a NumPy array, reached through host callbacks. A pytree without
    leaves whose identity is its static part: a jitted step is compiled for the store it reads."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.array = np.zeros(shape, jnp.dtype(dtype))

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def rows(self) -> np.ndarray:
        return self.array

    def _pages(self, page: jax.Array) -> jax.Array:
        """Page ids of the running data shard (inside ``mesh.per_shard``) -> pages of the whole array."""
        abstract = jax.sharding.get_abstract_mesh()
        if "data" not in abstract.manual_axes:
            return page
        return page + jax.lax.axis_index("data") * (self.array.shape[1] // abstract.shape["data"])

    def fetch(self, layer, page_BK: jax.Array, offset_BK: jax.Array) -> jax.Array:
        shape = jax.ShapeDtypeStruct(page_BK.shape + self.array.shape[-1:], self.array.dtype)
        read = mesh.all_manual(lambda l, p, o: jax.pure_callback(
            lambda l, p, o: self.array[int(l), np.asarray(p), np.asarray(o)], shape, l, p, o))
        return read(jnp.asarray(layer, jnp.int32), self._pages(page_BK), offset_BK)

    def backup(self, page_B: jax.Array, offset_B: jax.Array, rows_LBW: jax.Array) -> NumpyHostStore:
        def write(p, o, rows):
            self.array[:, np.asarray(p), np.asarray(o)] = np.asarray(rows)
        mesh.all_manual(lambda *args: io_callback(write, None, *args, ordered=True))(
            self._pages(page_B), offset_B, rows_LBW)
        return self

    def store_prompt(self, rows_LXZW: jax.Array, pages_X: jax.Array) -> NumpyHostStore:
        def write(rows, p):
            self.array[:, np.asarray(p)] = np.asarray(rows)
        mesh.all_manual(lambda *args: io_callback(write, None, *args, ordered=True))(rows_LXZW, self._pages(pages_X))
        return self

    def load(self, pages_X: jax.Array) -> jax.Array:
        # ordered after the step's earlier writes (store_prompt, backup): an io callback of the same ordering
        l, _, z, w = self.array.shape
        shape = jax.ShapeDtypeStruct((l, pages_X.shape[0], z, w), self.array.dtype)
        read = mesh.all_manual(lambda p: io_callback(lambda p: self.array[:, np.asarray(p)], shape, p, ordered=True))
        return read(self._pages(pages_X))


jax.tree_util.register_pytree_node(NumpyHostStore, lambda s: ((), s), lambda s, _: s)


HOST_STORES = (PinnedHostStore, NumpyHostStore)


def host_store(fetch: str, shape: tuple[int, ...], dtype) -> PinnedHostStore | NumpyHostStore:
    """An empty host store of ``shape`` for the fetch backend ``fetch``."""
    if fetch not in FETCH_BACKENDS:
        raise ValueError(f"--fetch {fetch!r} is not a fetch backend; use one of {', '.join(FETCH_BACKENDS)}")
    return PinnedHostStore.zeros(shape, dtype) if fetch == "inline" else NumpyHostStore(shape, dtype)
