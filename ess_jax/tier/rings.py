"""Compressor rings in the host tier: DeepSeek-V4's HCA compressor tails (the projected inputs and gate projections
of each request's open 128-token window, DOMAIN.md 2.4, 3.2) in a host store per batch row, the device keeping
only the newest position's projections.

A ring is appended one token per decode step and read whole only by the step that closes its window (once per
``m`` steps). Per HCA layer and batch row the host holds ``[U, Y]`` projections and gate projections (``U = m``
positions, slot ``position % U``); the device holds the newest position's row and its slot (``HostRings.slot``):

- ``begin_step``: the newest rows into their host slots, batched over layers, at the start of the next compiled
  step (the tier's backup path, ``host.*.backup``); a row written again unchanged is harmless, so nothing
  marks rows pending;
- ``read``: the rings of one layer for the rows whose window closes this step, fetched from the host (one
  fetch per closed window: none when no row closes, else the closing rows compacted, ``fetch_budget`` rows a
  fetch, as many fetches as they fill), with the newest row laid over its slot from the device, so the fetch
  never waits for this step's backup;
- ``appended``: the slots of the rows that ran this step;
- ``store_prompt``: a prefilled prompt's whole ring into its batch row.

The rings hold the same values the resident cache's rings hold (no format change), so the compressor pools
the same inputs in the same order: the step's entries are bit-identical.
Axis letters: ess_jax.notation (L layers, B batch rows, U ring slots, Y projection width, C fetched rows).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ess_jax.tier.host import fetch_wanted, host_store


def fetch_budget(rows: int) -> int:
    """Rows a step fetches whole rings for without falling back to every row: a 128-token window closes on
    one step in 128 per row, so ``rows / 16`` covers eight times the mean."""
    return max(1, rows // 16)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HostRings:
    """``L`` layers' rings of ``B`` batch rows in host stores ``[L, B, U, Y]`` (the batch row in the stores' page
    axis, the ring slot in their offset axis)."""

    kv: Any  # host.PinnedHostStore | host.NumpyHostStore: [L, B, U, Y] projected inputs (the ring's dtype)
    gate: Any  # [L, B, U, Y] gate projections (the ring's dtype)
    slot: jax.Array  # i32[B] the ring slot of the newest position, whose row the device holds

    def begin_step(self, newest_kv_LBY: jax.Array, newest_gate_LBY: jax.Array) -> HostRings:
        """The newest rows (every layer) into their slots of the host rings."""
        rows_B = jnp.arange(self.slot.shape[0], dtype=jnp.int32)
        return dataclasses.replace(self, kv=self.kv.backup(rows_B, self.slot, newest_kv_LBY),
                                   gate=self.gate.backup(rows_B, self.slot, newest_gate_LBY))

    def read(self, layer, closes_B: jax.Array, newest_kv_BY: jax.Array, newest_gate_BY: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
        """The rings ``[B, U, Y]`` of layer ``layer`` (an int, or i32[] inside a scan over layers) for the rows
        where ``closes_B``, with the newest rows over their slots (other rows: zeros and the newest row)."""
        b = closes_B.shape[0]
        u, y = self.kv.shape[2:]

        def read(rows_C):  # whole rings of batch rows rows_C (index b: none)
            c = rows_C.shape[0]
            page_CU = jnp.broadcast_to(jnp.minimum(rows_C, b - 1)[:, None], (c, u))
            slot_CU = jnp.broadcast_to(jnp.arange(u, dtype=jnp.int32), (c, u))
            return self.kv.fetch(layer, page_CU, slot_CU), self.gate.fetch(layer, page_CU, slot_CU)

        kv_BUY, gate_BUY = fetch_wanted(read, closes_B, fetch_budget(b), tuple(
            jax.ShapeDtypeStruct((b, u, y), store.dtype) for store in (self.kv, self.gate)))
        rows_B = jnp.arange(b)
        return (kv_BUY.at[rows_B, self.slot].set(newest_kv_BY.astype(kv_BUY.dtype)),
                gate_BUY.at[rows_B, self.slot].set(newest_gate_BY.astype(gate_BUY.dtype)))

    def appended(self, slot_B: jax.Array, ran_B: jax.Array) -> HostRings:
        """After a step: the rows that ran hold position ``slot_B``'s row on the device."""
        return dataclasses.replace(self, slot=jnp.where(ran_B, slot_B, self.slot).astype(jnp.int32))

    def store_prompt(self, row, kv_LUY: jax.Array, gate_LUY: jax.Array) -> tuple[HostRings, jax.Array, jax.Array]:
        """A prefilled prompt's rings (every layer) into batch row ``row`` (past the last: none). Returns the
        rings and the newest rows the device then holds for the row: its slot 0 (``slot`` set to 0)."""
        b = self.slot.shape[0]

        def put(stores):
            kv, gate = stores
            pages = jnp.reshape(row, (1,))
            return kv.store_prompt(kv_LUY[:, None], pages), gate.store_prompt(gate_LUY[:, None], pages)

        kv, gate = jax.lax.cond(row < b, put, lambda stores: stores, (self.kv, self.gate))
        slot = self.slot.at[row].set(0, mode="drop")
        return dataclasses.replace(self, kv=kv, gate=gate, slot=slot), kv_LUY[:, 0], gate_LUY[:, 0]


def init_host_rings(*, layers: int, rows: int, slots: int, width: int, dtype, fetch: str) -> HostRings:
    """Empty rings: ``slots`` positions of ``width`` values (``dtype``) per (layer, batch row) in host stores of
    the fetch backend ``fetch``, every row's newest position at slot 0."""
    shape = (layers, rows, slots, width)
    return HostRings(kv=host_store(fetch, shape, dtype), gate=host_store(fetch, shape, dtype),
                     slot=jnp.zeros((rows,), jnp.int32))
