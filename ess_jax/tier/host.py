"""The tier's host stores: every offloaded row of every admitted request, ``[L, G, Z, W]`` (the entries'
pages), behind one contract with two backends (DESIGN.md §5), tested for identical results.

- ``PinnedHostStore`` (``--fetch inline``): a jax array in pinned host memory. ``fetch`` gathers the rows
  on the host under ``compute_on("device_host")`` and transfers them inside the step; ``backup`` and
  ``store_prompt`` send only their rows to the host and write them there in place (dynamic updates of the donated
  store, all operands in host memory, which XLA:TPU runs on the host without a copy; under ``compute_on`` their
  result would come back in the host computation's own layout and be copied through the device), ``load`` (a cached
  prefix's whole pages) gathers there. One compiled step, no host round trip; the store itself never passes through
  device memory.

  Its array is page-major, ``[G, Z * L * W]``: a page's rows, each offset's rows of every layer side by side. A
  step's new row of every layer is then one contiguous update, and the array's shape gets the row-major layout
  from XLA:TPU's default layout chooser (a 4-d ``[L, G, Z, W]`` store gets a tiled layout with the page axis
  minor-most, which the host computations inside the step's scan over layers do not share: XLA then relays the
  whole store out through device memory every step).
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
    """``--fetch inline``: the rows ``[L, G, Z, W]`` in a pinned-host jax array laid out ``[G, Z * L * W]``."""

    def __init__(self, array: jax.Array, layers: int, width: int):
        self.array = array  # [G, Z * L * W] in pinned host memory: row (l, g, z) at [g, (z * L + l) * W ...]
        self.layers, self.width = layers, width  # L, W

    @classmethod
    def zeros(cls, shape: tuple[int, ...], dtype) -> PinnedHostStore:
        # zeros computed on the host side: the store never passes through device memory
        l, g, z, w = shape
        return cls(jax.jit(_ON_HOST(lambda: jnp.zeros((g, z * l * w), dtype)))(), l, w)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``[L, G, Z, W]``, the rows' shape."""
        g, zlw = self.array.shape
        z = zlw // (self.layers * self.width)
        return self.layers, g, z, self.width

    @property
    def dtype(self):
        return self.array.dtype

    @property
    def nbytes(self) -> int:
        return self.array.nbytes

    def rows(self) -> np.ndarray:
        """Every row ``[L, G, Z, W]``, on the host (tests, figures)."""
        l, g, z, w = self.shape
        return np.asarray(self.array).reshape(g, z, l, w).transpose(2, 0, 1, 3)

    def fetch(self, layer, page_BK: jax.Array, offset_BK: jax.Array) -> jax.Array:
        """Rows of layer ``layer`` (an int or i32[], traced inside a scan over layers) at (page, offset)
        ``[..., W]`` on the device (any leading shape)."""
        l, w = self.layers, self.width
        # every operand of a host computation must live in host memory, the layer index included
        column_BK = (offset_BK * l + layer) * w
        index = jax.device_put((page_BK, column_BK, jnp.arange(w, dtype=jnp.int32)), jax.memory.Space.Host)
        rows = _ON_HOST(lambda store, p, c, x: store[p[..., None], c[..., None] + x])(self.array, *index)
        return jax.device_put(rows, jax.memory.Space.Device)

    def backup(self, page_B: jax.Array, offset_B: jax.Array, rows_LBW: jax.Array) -> PinnedHostStore:
        """Every layer's row of each batch row at (page, offset) (``B``: any leading shape): each batch row's ``L``
        rows one update (``_write_rows``), only the rows sent to the host."""
        l, w = self.layers, self.width
        rows_BX = jnp.swapaxes(rows_LBW.reshape(l, -1, w), 0, 1).reshape(-1, l * w).astype(self.array.dtype)
        operands = jax.device_put((page_B.reshape(-1), offset_B.reshape(-1) * (l * w), rows_BX), jax.memory.Space.Host)
        return PinnedHostStore(_write_rows(self.array, *operands), l, w)

    def store_prompt(self, rows_LXZW: jax.Array, pages_X: jax.Array) -> PinnedHostStore:
        """Whole pages of rows at ``pages_X``: each page one update (``_write_rows``)."""
        l, x, z, w = rows_LXZW.shape
        pages_XR = jnp.transpose(rows_LXZW, (1, 2, 0, 3)).reshape(x, z * l * w).astype(self.array.dtype)
        operands = jax.device_put((pages_X, jnp.zeros_like(pages_X), pages_XR), jax.memory.Space.Host)
        return PinnedHostStore(_write_rows(self.array, *operands), l, w)

    def load(self, pages_X: jax.Array) -> jax.Array:
        """Whole pages ``pages_X`` of rows on the device ``[L, X, Z, W]``, gathered on the host side."""
        l, _, z, w = self.shape
        rows = _ON_HOST(lambda store, p: store[p])(self.array, jax.device_put(pages_X, jax.memory.Space.Host))
        rows = jax.device_put(rows, jax.memory.Space.Device)
        return jnp.transpose(rows.reshape(-1, z, l, w), (2, 0, 1, 3))


def _write_rows(store: jax.Array, page_N: jax.Array, column_N: jax.Array, rows_NX: jax.Array) -> jax.Array:
    """``store`` (in host memory, as every operand) with each row ``rows_NX[i]`` written at ``(page_N[i],
    column_N[i])``, one at a time in a loop on the host: the program does not grow with ``N`` (unrolled, V4-Flash's
    decode at batch 1906 was a program XLA:GPU did not compile in 10 minutes), and XLA:TPU updates the store in place
    (unrolled, it made a new store-sized host buffer)."""
    def write(carry):
        i, store = carry
        row = jax.lax.dynamic_slice_in_dim(rows_NX, i, 1)
        return i + 1, jax.lax.dynamic_update_slice(store, row, (page_N[i], column_N[i]))

    return jax.lax.while_loop(lambda carry: carry[0] < rows_NX.shape[0], write, (jnp.int32(0), store))[1]


jax.tree_util.register_pytree_node(PinnedHostStore, lambda s: ((s.array,), (s.layers, s.width)),
                                   lambda aux, children: PinnedHostStore(*children, *aux))


class NumpyHostStore:
    """``--fetch split``: the rows in a NumPy array, reached through host callbacks. A pytree without
    leaves whose identity is its static part: a jitted step is compiled for the store it reads."""

    def __init__(self, shape: tuple[int, ...], dtype):
        self.array = np.zeros(shape, jnp.dtype(dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    @property
    def dtype(self):
        return self.array.dtype

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


def fetch_wanted(read, want_X: jax.Array, chunk: int, like):
    """Rows of every item ``want_X`` marks, ``like``'s shapes (a pytree of ``[X, ...]`` shapes; zeros where not
    wanted), read ``chunk`` items at a time by ``read(at_C)`` (``i32[C]`` item ids, ``X`` = none; a pytree like
    ``like`` of ``[C, ...]`` rows): the wanted items compacted, as many chunks as they fill, none when nothing is
    wanted. A step then moves its wanted rows rounded up to a chunk, exact however many it wants. (A loop, not a
    conditional: XLA:TPU places host computations inside loops, not inside conditionals.)"""
    x = want_X.shape[0]
    order_X = jnp.nonzero(want_X, size=x + chunk, fill_value=x)[0].astype(jnp.int32)

    def body(carry):
        start, out = carry
        at_C = jax.lax.dynamic_slice(order_X, (start,), (chunk,))
        return start + chunk, jax.tree.map(lambda o, r: o.at[at_C].set(r.astype(o.dtype), mode="drop"), out, read(at_C))

    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), like)
    return jax.lax.while_loop(lambda c: c[0] < want_X.sum(), body, (jnp.zeros((), jnp.int32), zeros))[1]


def host_store(fetch: str, shape: tuple[int, ...], dtype) -> PinnedHostStore | NumpyHostStore:
    """An empty host store of ``shape`` for the fetch backend ``fetch``."""
    if fetch not in FETCH_BACKENDS:
        raise ValueError(f"--fetch {fetch!r} is not a fetch backend; use one of {', '.join(FETCH_BACKENDS)}")
    return PinnedHostStore.zeros(shape, dtype) if fetch == "inline" else NumpyHostStore(shape, dtype)
