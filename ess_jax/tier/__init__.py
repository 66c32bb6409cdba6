"""The offloaded tier (ESS for DeepSeek-V3.2's latent rows, HiSparse for DeepSeek-V4's CSA entries):
``lru`` (slot tables, recency order, residency map), ``host`` (the pinned-host and NumPy host stores
behind one contract), ``store`` (the tier as a cache store: ``read`` -> row sources), ``rings`` (V4's HCA
compressor rings in host stores)."""

from ess_jax.tier.host import FETCH_BACKENDS, HOST_STORES, NumpyHostStore, PinnedHostStore
from ess_jax.tier.lru import WARMUP_QUERIES, LruPool, pool_slots, resolve, warm_layer
from ess_jax.tier.rings import HostRings, init_host_rings
from ess_jax.tier.store import Tier, device_bytes, init_tier, share_sources

__all__ = ["FETCH_BACKENDS", "HOST_STORES", "NumpyHostStore", "PinnedHostStore", "WARMUP_QUERIES", "LruPool",
           "pool_slots", "resolve", "warm_layer", "HostRings", "init_host_rings", "Tier", "device_bytes", "init_tier",
           "share_sources"]
