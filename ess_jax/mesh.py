"""The device mesh (``--mesh data=D,expert=E``) and the sharding rules, in one place.

- ``parse`` reads the flag; ``make`` builds the ``jax.sharding.Mesh`` over the devices jax sees (their count
  must equal the mesh's size). Its axis types are given explicitly as ``Auto``: the partitioner propagates
  the parameters' and caches' shardings through the step. (``Explicit`` axes would need every op of the
  models to have an explicit-sharding rule, and ``ragged_dot_general``, the routed experts' matmul, has none
  in jax 0.11 without an ``out_sharding``.) The engine runs its steps under ``jax.set_mesh``.
- Parameters (``param_spec``): the routed experts' stacked weights (``experts.gate_up_proj [..., E, 2F, D]``,
  ``experts.down_proj [..., E, D, F]``, and the values and scales of their release formats, expert axis
  third from last) over ``expert``; everything else (attention, indexer, router, shared experts,
  embeddings) replicated. The routed experts run where they are held (``over_experts``: a ``shard_map`` over
  ``expert``, the tokens' partial sums all-reduced), so no step gathers an expert's weights.
- Caches (``cache_shardings``): every array over ``data``, on its batch-row axis (V3.2 and V4 ESS pools, slot
  tables, residency maps and staged rows; V4's window and compressor rings) or its page axis (the page pools,
  the host store in its own memory kind: each data shard's rows in its own devices' host memory; the prefill
  scratch, one row and one request's pages per shard). Each shard has its own pages (the engine's
  allocator per shard, page ids local to it, its own null page), and the steps run per shard
  (``per_shard``: ``shard_map`` over ``data``), so no page ever crosses shards.

The model is exact on any mesh: sharding moves data, never changes what a row computes, so greedy tokens
equal one device's.

Several processes (``Processes``, ``--num-processes``): every process runs the same command, so the same
engine with the same host bookkeeping; ``start`` joins them through ``jax.distributed`` (gloo collectives on
CPU) before jax sees a device, and the mesh then spans every process's devices. The host reads the steps'
results with ``host_array`` (an array sharded over devices of other processes is gathered from them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

AXES = ("data", "expert")  # mesh axes in mesh order


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Devices along each mesh axis."""

    data: int = 1
    expert: int = 1

    @property
    def size(self) -> int:
        return self.data * self.expert

    def __str__(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in AXES)


def parse(text: str) -> MeshShape:
    """``"data=D,expert=E"`` (either may be left out: 1) -> MeshShape; ValueError naming the fix."""
    if not isinstance(text, str):
        raise ValueError(f"mesh={text!r} must be a string such as 'data=2,expert=4'")
    sizes: dict[str, int] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"--mesh {text!r}: {item.strip()!r} is not AXIS=SIZE; write e.g. data=2,expert=4")
        if name == "tensor":
            raise ValueError(f"--mesh {text!r}: tensor parallelism is not served yet; use data and expert axes")
        if name not in AXES:
            raise ValueError(f"--mesh {text!r}: unknown axis {name!r}; the axes are {', '.join(AXES)}")
        if name in sizes:
            raise ValueError(f"--mesh {text!r}: axis {name!r} is given twice")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1 or str(size) != value.strip():
            raise ValueError(f"--mesh {text!r}: {name}={value.strip()!r} must be a positive integer")
        sizes[name] = size
    return MeshShape(**sizes)


@dataclasses.dataclass(frozen=True)
class Processes:
    """The processes one run spans: ``count`` of them, this one ``index``, joined at ``coordinator``
    (``host:port``, process 0's address)."""

    count: int = 1
    index: int = 0
    coordinator: str | None = None

    def __post_init__(self):
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"--num-processes {self.count!r} must be an integer >= 1")
        if isinstance(self.index, bool) or not isinstance(self.index, int) or not 0 <= self.index < self.count:
            raise ValueError(f"--process-id {self.index!r} must be an integer in [0, {self.count}) "
                             f"(--num-processes {self.count})")
        if self.count > 1:
            host, sep, port = (self.coordinator or "").rpartition(":")
            if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"--num-processes {self.count} needs --coordinator HOST:PORT (process 0's address, "
                                 f"e.g. 127.0.0.1:1234), got {self.coordinator!r}")


def start(processes: Processes) -> None:
    """Join the run's processes (``jax.distributed.initialize``; CPU collectives over gloo) before jax uses a
    device; one process: nothing to do."""
    if processes.count > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(processes.coordinator, processes.count, processes.index)


def host_array(x: jax.Array) -> np.ndarray:
    """``x`` on the host, whole: read directly when this process holds all of it (one process, or replicated),
    else gathered from the processes that hold its shards (a collective: every process calls it alike)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check_devices(shape: MeshShape) -> None:
    """ValueError unless jax sees exactly the mesh's number of devices."""
    devices = jax.devices()
    if shape.size != len(devices):
        raise ValueError(
            f"--mesh {shape} has {shape.size} devices but jax sees {len(devices)} ({devices[0].platform}): give "
            f"axis sizes whose product is {len(devices)}, or on CPU simulate {shape.size} devices with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={shape.size} set before jax starts")


def make(shape: MeshShape) -> jax.sharding.Mesh:
    """The mesh of ``shape`` over every device jax sees (``check_devices``)."""
    check_devices(shape)
    sizes = tuple(getattr(shape, name) for name in AXES)
    return jax.make_mesh(sizes, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=jax.devices())


def path_names(path) -> list[str]:
    """A pytree key path as names: ``['runs', '1', 'mlp', 'experts', 'down_proj', 'value']``."""
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def param_spec(names: list[str], shape: tuple[int, ...]) -> PartitionSpec:
    """The sharding rule of the parameter at state path ``names``: the routed experts' weights over
    ``expert`` on their expert axis (third from last: ``[..., E, out, in]``), everything else replicated."""
    if "experts" in names and len(shape) >= 3:
        axes = [None] * len(shape)
        axes[len(shape) - 3] = "expert"
        return PartitionSpec(*axes)
    return PartitionSpec()


def expert_shards() -> int:
    """Devices along the ``expert`` axis of the mesh the step is traced on, when the partitioner splits the routed
    experts over it (an ``Auto`` axis); 1 without a mesh, without the axis, or where it is manual."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty or "expert" not in abstract.axis_names or "expert" in abstract.manual_axes:
        return 1
    return abstract.shape["expert"]


def over_experts(fn: Callable, tokens, experts):
    """Expert parallelism: ``fn(tokens, experts, first) -> f32[A, D]``, a sum over the routed experts ``experts``
    holds (a pytree of arrays, each with its expert axis third from last, the ``param_spec`` rule; ``first``: the
    id of the first), run on each device of the ``expert`` axis over the experts it holds (``jax.shard_map``:
    ``tokens`` the same on every device of the axis, as the replicated attention leaves them; the mesh's other
    axes manual too, their devices computing alike, as Pallas TPU kernels need), the partial sums
    added over the axis: one all-reduce of the result per call, and no expert's weights leave their device.
    Without an expert axis to split (``expert_shards``): ``fn(tokens, experts, 0)``."""
    if expert_shards() == 1:
        return fn(tokens, experts, 0)
    specs = jax.tree.map(lambda x: PartitionSpec(*[None] * (x.ndim - 3), "expert"), experts)

    def held(tokens, experts):
        first = jax.lax.axis_index("expert") * jax.tree.leaves(experts)[0].shape[-3]
        return jax.lax.psum(fn(tokens, experts, first), "expert")

    abstract = jax.sharding.get_abstract_mesh()  # every axis manual: TPU kernels are not partitioned automatically
    auto = set(abstract.axis_names) - set(abstract.manual_axes)
    return jax.shard_map(held, in_specs=(PartitionSpec(), specs), out_specs=PartitionSpec(), axis_names=auto,
                         check_vma=False)(tokens, experts)


def param_bytes_per_device(params, shape: MeshShape) -> int:
    """Bytes of ``params`` (an NNX state) on each device of a mesh of ``shape`` (``param_spec``)."""
    return sum(int(x.nbytes) // (shape.expert if param_spec(path_names(p), x.shape) else 1)
               for p, x in jax.tree_util.tree_leaves_with_path(params))


def check_experts(experts: int, expert_size: int, where: str = "") -> None:
    """ValueError unless ``experts`` routed experts divide over an ``expert`` axis of ``expert_size`` (whole
    experts on each device); ``where`` names the parameter."""
    if experts % expert_size:
        raise ValueError(f"--mesh expert={expert_size} does not divide the model's {experts} routed experts{where}: "
                         "use an expert size that divides it")


def param_sharding(mesh: jax.sharding.Mesh, names: list[str], shape: tuple[int, ...]) -> NamedSharding:
    """The sharding on ``mesh`` of the parameter at state path ``names`` of ``shape`` (``param_spec``);
    ValueError when its routed experts do not divide over the ``expert`` axis."""
    spec = param_spec(names, shape)
    if spec:
        check_experts(shape[len(shape) - 3], mesh.shape["expert"], f" ({'.'.join(names)})")
    return NamedSharding(mesh, spec)


def place_params(params, mesh: jax.sharding.Mesh):
    """``params`` (an NNX state) on ``mesh`` by ``param_sharding``; ValueError when the experts do not divide
    over the ``expert`` axis. Parameters already placed so are not copied."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, param_sharding(mesh, path_names(path), x.shape)), params)


def shard_axes(build: Callable[[int, int], object]) -> list[int | None]:
    """Each array's data-shard axis (None: it has none) in the cache ``build(rows, pages)`` makes, in leaf order:
    the batch-row axis or the page axis, found as the axis that follows the row count (2, then 3) or the page
    count (5, then 7) (shapes only: nothing is allocated but leafless parts, such as the split backend's NumPy
    store)."""
    small, large = (jax.tree.leaves(jax.eval_shape(lambda: build(rows, pages))) for rows, pages in ((2, 5), (3, 7)))
    return [next((i for i, sizes in enumerate(zip(a.shape, b.shape)) if sizes in ((2, 3), (5, 7))), None)
            for a, b in zip(small, large, strict=True)]


def cache_shardings(make: Callable[[object], object], size, mesh: jax.sharding.Mesh):
    """The cache ``make(size)`` as shapes, and the shardings of its arrays (a pytree like it; ``size`` has ``rows``
    and ``pages``): each over ``data`` on the batch-row or page axis ``shard_axes`` finds, the rest replicated, each
    in the memory kind ``make`` puts it in (the host stores' ``pinned_host``; otherwise the default). Shapes only:
    ``make`` is traced, nothing allocated but leafless parts. ``mesh`` may be a ``jax.sharding.AbstractMesh``
    (shapes per device without the devices)."""
    closed, shapes = jax.make_jaxpr(lambda: make(size), return_shape=True)()
    leaves, treedef = jax.tree.flatten(shapes)
    axes = shard_axes(lambda rows, pages: make(dataclasses.replace(size, rows=rows, pages=pages)))

    def sharding(x, aval, axis):
        spec = [None] * x.ndim
        if axis is not None:
            spec[axis] = "data"
        kind = "pinned_host" if aval.memory_space == jax.memory.Space.Host else None
        return NamedSharding(mesh, PartitionSpec(*spec), memory_kind=kind)

    return shapes, jax.tree.unflatten(treedef, [sharding(x, aval, axis) for x, aval, axis
                                                in zip(leaves, closed.out_avals, axes, strict=True)])


def batch_rows(requests: int, max_batch: int, mesh: str | None) -> int:
    """The batch rows a workload of ``requests`` uses: no more than ``max_batch``, a multiple of the data shards
    of ``mesh`` (the ``--mesh`` text; None: one device)."""
    shards = parse(mesh).data if mesh else 1
    return min(max_batch, -(-requests // shards) * shards)


def check_rows(shape: MeshShape, max_batch: int) -> None:
    if max_batch % shape.data:
        raise ValueError(f"--max-batch {max_batch} does not divide over --mesh data={shape.data}: use a multiple "
                         f"of {shape.data} (e.g. {math.ceil(max_batch / shape.data) * shape.data})")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The shardings of a cache's arrays, hashable: a static argument of the compiled steps, which run per
    data shard on them (``per_shard``) and constrain the cache they return to them (so every step gets the
    cache in the shardings it was compiled for)."""

    treedef: jax.tree_util.PyTreeDef
    shardings: tuple[NamedSharding, ...]

    @classmethod
    def of(cls, shardings) -> Layout:
        leaves, treedef = jax.tree.flatten(shardings)
        return cls(treedef, tuple(leaves))

    @property
    def specs(self):
        """The cache's partition specs (a pytree like it): ``shard_map``'s specs of the cache."""
        return jax.tree.unflatten(self.treedef, [s.spec for s in self.shardings])

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.shardings[0].mesh

    def constrain(self, cache):
        leaves = jax.tree.leaves(cache)
        return jax.tree.unflatten(self.treedef, [jax.lax.with_sharding_constraint(x, s)
                                                 for x, s in zip(leaves, self.shardings, strict=True)])


def per_shard(fn: Callable, mesh: jax.sharding.Mesh, in_specs, out_specs) -> Callable:
    """``fn`` run on each data shard's part of its arguments (``jax.shard_map`` over ``data``, the other axes
    left to the partitioner: the routed experts stay split over ``expert``). Its batch-row and page arguments
    are the shard's own: page ids local to the shard's pool, batch rows numbered from 0 on each shard. Every
    result is per shard (``out_specs`` over ``data``): values are not tracked as varying over it
    (``check_vma=False``), so the models' scans may start from constants. One data shard: ``fn`` itself, on the
    whole mesh (an axis of size 1 is made manual otherwise: the partitioner refuses the split backend's host
    callbacks under a ``shard_map`` whose only Auto axes have one device)."""
    if mesh.shape["data"] == 1:  # one shard: the step as it is, the partitioner splitting the experts
        return fn
    # an axis of one device: nothing to split
    manual = {"data"} | {name for name, size in mesh.shape.items() if size == 1}
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual, check_vma=False)


def all_manual(fn: Callable) -> Callable:
    """``fn`` where every mesh axis is manual: inside ``per_shard`` a nested ``jax.shard_map`` over the axes
    still left to the partitioner, its arguments and results the same on each of their devices (host callbacks
    run only where every axis is manual; each device of the shard calls them alike). Elsewhere ``fn``."""
    abstract = jax.sharding.get_abstract_mesh()
    rest = set(abstract.axis_names) - set(abstract.manual_axes) if not abstract.empty else set()
    if not rest:
        return fn
    return jax.shard_map(fn, in_specs=PartitionSpec(), out_specs=PartitionSpec(), axis_names=rest, check_vma=False)
