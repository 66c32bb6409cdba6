"""Compile-only targets: the real compilers of TPUs (libtpu, Mosaic TPU included) and NVIDIA GPUs (XLA:GPU through
jax's CUDA plugin) run on a machine without either device (DOMAIN.md §7), and what a compiled program says.

A ``Spec`` is a target device's facts: jax's device kind, HBM bytes and bandwidth, peak dense bf16 FLOP/s (what the
roofline divides by) and, for an NVIDIA GPU, the ``stream_executor.GpuTargetConfigProto`` fields XLA:GPU compiles
for (``gpu_target_config``). ``compile_mesh`` builds a ``jax.sharding.Mesh`` of compile-only devices of a spec
(``jax.experimental.topologies``); ``jax.jit(f).lower(*shapes).compile()`` over arguments sharded on it runs that
target's compiler. ``analyze`` reads the compiled program: bytes per device from ``memory_analysis``, the
collectives and custom calls and the host transfers from the scheduled HLO (each counted as many times as the
loops around it run), ``cost_analysis`` FLOPs and bytes (XLA:GPU compile-only has none: ``HostKindsCompiled``), and
the roofline time they imply.

Needs the ``aot`` extra (``pip install 'ess_jax[aot]'``: libtpu, and jax's CUDA plugin without the CUDA
libraries, which compiling does not load); ``available(platform)`` says whether it is installed.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import math
import os
import re

import numpy as np
from jax.sharding import AxisType, Mesh

from ess_jax import mesh as device_mesh

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Spec:
    """A target device. ``name``: the CLI's (``--target``); ``kind``: jax's ``device_kind``; ``hbm_bytes`` the
    memory a program may use, ``hbm_bandwidth`` in bytes/s, ``peak_flops`` dense bf16 FLOP/s; TPU: the topology
    generation (``generation:AxB``); NVIDIA: ``gpu`` the device-info fields of its target config."""

    name: str
    platform: str  # "tpu" or "cuda"
    kind: str
    hbm_bytes: int
    hbm_bandwidth: float
    peak_flops: float
    generation: str = ""
    gpu: dict | None = None


def _nvidia(name, kind, *, sms, memory, bandwidth, clock, l2, smem, smem_optin, capability, fpus, flops) -> Spec:
    info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
                shared_memory_per_core=smem, threads_per_core_limit=2048, core_count=sms, fpus_per_core=fpus,
                block_dim_limit_x=2147483647, block_dim_limit_y=65535, block_dim_limit_z=65535,
                memory_bandwidth=int(bandwidth), l2_cache_size=l2, clock_rate_ghz=clock, device_memory_size=memory,
                shared_memory_per_block_optin=smem_optin, registers_per_core_limit=65536,
                registers_per_block_limit=65536, thread_dim_limit_x=1024, thread_dim_limit_y=1024,
                thread_dim_limit_z=64, capability=capability)
    return Spec(name, "cuda", kind, memory, bandwidth, flops, gpu=info)


# Vendors' figures (HBM, bandwidth, dense bf16 peak; NVIDIA's SM counts, clocks, caches and shared memory as XLA's
# own GPU specs record them). TPU HBM: what libtpu's compiler allows a program (v5e: 15.75 GiB of 16).
SPECS = {s.name: s for s in (
    Spec("v5e", "tpu", "TPU v5 lite", int(15.75 * GIB), 819e9, 197e12, generation="v5e"),
    Spec("v6e", "tpu", "TPU v6 lite", int(31.25 * GIB), 1640e9, 918e12, generation="v6e"),
    Spec("v5p", "tpu", "TPU v5", int(95.74 * GIB), 2765e9, 459e12, generation="v5p"),
    _nvidia("H100", "NVIDIA H100 80GB HBM3", sms=132, memory=84942979072, bandwidth=3.35232e12, clock=1.98,
            l2=52428800, smem=233472, smem_optin=232448, capability=(9, 0), fpus=128, flops=989.4e12),
    _nvidia("H200", "NVIDIA H200", sms=132, memory=151397597184, bandwidth=4.8e12, clock=1.98, l2=52428800,
            smem=233472, smem_optin=232448, capability=(9, 0), fpus=128, flops=989.4e12),
    _nvidia("A100", "NVIDIA A100-SXM4-80GB", sms=108, memory=85100068864, bandwidth=2.03904e12, clock=1.41,
            l2=41943040, smem=167936, smem_optin=166912, capability=(8, 0), fpus=64, flops=312e12),
    _nvidia("B200", "NVIDIA B200", sms=148, memory=191514411008, bandwidth=7.67232e12, clock=1.965, l2=132644864,
            smem=233472, smem_optin=232448, capability=(10, 0), fpus=128, flops=2250e12),
)}
_PLUGINS = {"tpu": "libtpu", "cuda": "jax_plugins.xla_cuda12"}


def spec(name: str) -> Spec:
    if name not in SPECS:
        raise ValueError(f"--target {name!r} is not a compile target; use one of {', '.join(SPECS)}")
    return SPECS[name]


def available(platform: str) -> bool:
    """Whether this machine can compile for ``platform`` ("tpu" or "cuda"): the ``aot`` extra is installed."""
    try:
        return importlib.util.find_spec(_PLUGINS[platform]) is not None
    except ModuleNotFoundError:
        return False


def gpu_target_config(s: Spec) -> str:
    """The ``GpuTargetConfigProto`` text of an NVIDIA spec."""
    info = dict(s.gpu)
    major, minor = info.pop("capability")
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    capability = f"  cuda_compute_capability {{\n    major: {major}\n    minor: {minor}\n  }}\n"
    return (f"gpu_device_info {{\n{fields}\n{capability}}}\n"
            f'platform_name: "CUDA"\ndnn_version_info {{\n  major: 9\n  minor: 10\n}}\n'
            f'device_description_str: "{s.kind}"\n')


def _tpu_topology(generation: str, count: int) -> str:
    """The smallest slice of ``generation`` with at least ``count`` chips (whole hosts: 2x2 at least)."""
    if generation == "v5p":  # 3-D torus
        for shape in ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4)):
            if math.prod(shape) >= count:
                return f"v5p:{'x'.join(map(str, shape))}"
    else:
        for shape in ((2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)):
            if math.prod(shape) >= count:
                return f"{generation}:{shape[0]}x{shape[1]}"
    raise ValueError(f"no {generation} slice with {count} chips")


def compile_devices(s: Spec, count: int) -> list:
    """``count`` compile-only devices of ``s`` (ValueError naming the extra to install when the compiler is not)."""
    if not available(s.platform):
        what = "jax[tpu]==0.11.2 (libtpu)" if s.platform == "tpu" else "jax's CUDA plugin (jax-cuda12-plugin==0.11.2)"
        raise ValueError(f"compiling for {s.name} needs {what}: pip install 'ess_jax[aot]'")
    from jax.experimental import topologies

    if s.platform == "tpu":
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compiling takes no chip: no exclusive lock
        topology = topologies.get_topology_desc(topology_name=_tpu_topology(s.generation, count), platform="tpu")
    else:
        topology = topologies.get_topology_desc(topology_name="", platform="cuda", target_config=gpu_target_config(s),
                                                topology=f"1 x 1 x {count}")
    return list(topology.devices)[:count]


def compile_mesh(s: Spec, shape: device_mesh.MeshShape) -> Mesh:
    """A mesh of ``shape`` (the engine's axes) over compile-only devices of ``s``."""
    devices = np.array(compile_devices(s, shape.size)).reshape(tuple(getattr(shape, a) for a in device_mesh.AXES))
    return Mesh(devices, device_mesh.AXES, axis_types=(AxisType.Auto,) * len(device_mesh.AXES))


@dataclasses.dataclass(frozen=True)
class HostKindsCompiled:
    """A program compiled by ``compile_with_host_memory``, read as ``analyze`` reads a ``jax.stages.Compiled``."""

    executable: object  # jaxlib's Executable

    def memory_analysis(self):
        return self.executable.get_compiled_memory_stats()

    def cost_analysis(self):
        """XLA:GPU's compile-only client has none ("GetCostAnalysis is not supported"). Instead: the optimized
        program's FLOPs (``counted_flops``), and as its bytes the least the step moves, its arguments read and its
        results written once (aliased ones once), so the roofline it gives is a lower bound."""
        from jax.errors import JaxRuntimeError

        try:
            return self.executable.cost_analysis()
        except JaxRuntimeError:
            memory = self.memory_analysis()
            return {"flops": counted_flops(self.as_text()),
                    "bytes accessed": float(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                            - memory.alias_size_in_bytes)}

    def as_text(self) -> str:
        return self.executable.hlo_modules()[0].to_string()


def compile_with_host_memory(jitted, args, s: Spec, kwargs: dict | None = None) -> HostKindsCompiled:
    """``jitted`` over ``args`` (``ShapeDtypeStruct``s sharded on a mesh of *CPU* devices, host arrays in
    ``pinned_host``) compiled for NVIDIA target ``s`` on as many compile-only GPUs. Compile-only NVIDIA devices list
    no memories, so a sharding on them drops ``pinned_host`` (the host store becomes a device array); the CPU devices
    have it, so the program is lowered for ``cuda`` from there (its arguments and results keep
    ``mhlo.memory_kind``) and compiled by the compile-only client: XLA:GPU lays the host arrays out in host memory
    (``S(5)``) and runs its host offloader on them."""
    import jax
    from jax._src import compiler
    from jax._src.lib import xla_client

    lowered = jitted.trace(*args, **(kwargs or {})).lower(lowering_platforms=(s.platform,))
    count = len({d for a in jax.tree.leaves(args) if getattr(a, "sharding", None) is not None
                 for d in a.sharding.device_set})
    devices = compile_devices(s, count)
    options = compiler.get_compile_options(num_replicas=1, num_partitions=count,
                                           device_assignment=np.array([d.id for d in devices]).reshape(1, count),
                                           backend=devices[0].client)
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.use_shardy_partitioner = True
    return HostKindsCompiled(compiler.backend_compile_and_load(devices[0].client, lowered.compiler_ir("stablehlo"),
                                                               xla_client.DeviceList(tuple(devices)), options, []))


# ---- reading a compiled program -----------------------------------------------------------------------------------

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute",
               "collective-broadcast")
_PASS_THROUGH = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-done", "opt-barrier",
                 "while", "conditional", "call", "after-all", "add-dependency"}


def _arrays(text: str) -> list[tuple[str, tuple[int, ...], bool]]:
    """The arrays of an HLO type ``text``: (dtype, shape, in host memory: layout memory space S(5))."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype in _DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d), "S(5)" in (layout or "")))
    return out


def _bytes(arrays) -> int:
    return int(sum(math.prod(shape) * _DTYPE_BYTES[dtype] for dtype, shape, _ in arrays))


@dataclasses.dataclass
class _Instruction:
    name: str
    computation: str
    opcode: str
    arrays: list  # of its result
    operands: list[str]
    called: list[str]  # computations it calls
    trips: int  # a while loop's known trip count (1 otherwise)
    text: str


def _bound(instructions: dict[str, _Instruction], condition: str) -> int:
    """The trip count of a while loop whose ``condition`` computation returns ``compare(counter, constant N),
    direction=LT`` (a scan's, its counter from 0 by 1): N; 1 for any other condition (a loop bounded by data)."""
    for ins in instructions.values():
        if ins.computation == condition and ins.opcode == "compare" and ins.text.lstrip().startswith("ROOT") \
                and "direction=LT" in ins.text and len(ins.operands) == 2:
            bound = instructions.get(ins.operands[1])
            if bound is not None and bound.opcode == "constant" and bound.computation == condition:
                value = re.search(r"constant\((\d+)\)", bound.text)
                return int(value[1]) if value else 1
    return 1


def _parse(hlo: str) -> tuple[dict[str, _Instruction], dict[str, int]]:
    """The scheduled HLO's instructions by name, and how many times each computation runs per call of the entry
    (while bodies times their known trip counts; fusions, calls and branches once)."""
    instructions, computation, entry = {}, None, None
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            computation = m[1]
            entry = computation if line.startswith("ENTRY") else entry
            continue
        m = _INSTRUCTION.match(line)
        if not m or computation is None:
            continue
        name, type_text, opcode, rest = m.groups()
        args = rest.split("),", 1)[0]
        called = re.findall(r"(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)", rest)
        for group in re.findall(r"branch_computations=\{([^}]*)\}", rest):
            called += [c.strip().lstrip("%") for c in group.split(",")]
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
        instructions[name] = _Instruction(name, computation, opcode, _arrays(type_text),
                                          re.findall(r"%([\w.\-]+)", args), called, int(trips[1]) if trips else 1,
                                          line)
    for ins in instructions.values():  # XLA:TPU leaves the trip count out: the condition's `i < N`, N a constant
        if ins.opcode == "while" and "known_trip_count" not in ins.text:
            ins.trips = _bound(instructions, re.search(r"condition=%?([\w.\-]+)", ins.text)[1])
    runs = collections.Counter({entry: 1})
    callers = collections.defaultdict(list)
    for ins in instructions.values():
        for c in ins.called:
            callers[c].append(ins)

    def count(c, seen=()):
        if c in runs:
            return runs[c]
        if c in seen:
            return 0
        total = sum(count(i.computation, seen + (c,)) * (i.trips if i.opcode == "while" else 1) for i in callers[c])
        runs[c] = total
        return total

    for ins in instructions.values():
        count(ins.computation)
    return instructions, dict(runs)


def _with_entry(hlo: str, computation: str) -> str:
    """The module ``hlo`` with ``computation`` as its entry (the header's entry layout, aliases and schedule, which
    name the old entry, dropped) and the attribute HLO's parser refuses (a collective's
    ``output_to_operand_aliasing``) removed."""
    lines = []
    for line in hlo.splitlines()[1:]:
        line = line.removeprefix("ENTRY ")
        if (m := _COMPUTATION.match(line)) and m[1] == computation:
            line = "ENTRY " + line
        lines.append(re.sub(r", output_to_operand_aliasing=\{\{[^}]*\}: \([^)]*\)\}", "", line))
    return "\n".join([hlo.split("\n", 1)[0].split(",")[0], *lines])


def counted_flops(hlo: str) -> float:
    """FLOPs of the optimized program ``hlo`` by XLA's target-independent ``HloCostAnalysis`` (run by this machine's
    CPU client), for a compiler that reports none (XLA:GPU compile-only): the analysis counts a while loop's body
    once, so each loop body is analysed as an entry of its own and counted as often as it runs (``_parse``'s trip
    counts). (Its bytes are not used: over XLA:GPU's fusions of the layer loop it counts many times what the step's
    arrays hold.)"""
    import jax
    from jax._src.lib import xla_client
    from jaxlib import _hlo

    instructions, runs = _parse(hlo)
    client = jax.devices("cpu")[0].client
    body = {ins.name: re.search(r"body=%?([\w.\-]+)", ins.text)[1] for ins in instructions.values()
            if ins.opcode == "while"}
    entry = next(iter(runs))  # ``_parse`` counts from the entry
    flops = {c: xla_client._xla.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(_with_entry(hlo, c)))
             .get("flops", 0.0) for c in (entry, *body.values())}  # each with its loops' bodies once
    caller = {called: ins.computation for ins in instructions.values() for called in ins.called}

    def owner(computation: str) -> str:  # the entry or loop body a computation (a branch, a call) runs within
        return computation if computation in flops else owner(caller[computation])

    own = dict(flops)
    for w in instructions.values():
        if w.opcode == "while":
            own[owner(w.computation)] -= flops[body[w.name]]
    return sum(runs.get(c, 1) * f for c, f in own.items()) + _grouped_matmul_flops(instructions, runs)


def _grouped_matmul_flops(instructions: dict[str, _Instruction], runs: dict[str, int]) -> float:
    """The FLOPs of the grouped matmul kernels (``models.layers.grouped_matmul``'s custom calls, in its named scope
    ``grouped_matmul``), which the analysis cannot see into: ``2 M N K`` for ``[M, K]`` rows into ``[M, N]``, as if
    every row were in a group (the work of the rows in groups is at most that)."""
    total = 0.0
    for ins in instructions.values():
        if ins.opcode == "custom-call" and re.search(r'op_name="[^"]*/grouped_matmul/', ins.text):
            (_, (m, n), _), (_, (_, k), _) = ins.arrays[0], instructions[ins.operands[1]].arrays[0]
            total += runs.get(ins.computation, 1) * 2.0 * m * n * k
    return total


def analyze(compiled, s: Spec) -> dict:
    """What the compiled program needs and moves on one device of ``s``."""
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    instructions, runs = _parse(hlo)
    collectives: dict[str, dict] = {}
    calls = collections.Counter()
    to_device = to_host = 0
    for ins in instructions.values():
        times = runs.get(ins.computation, 1)
        base = ins.opcode.removesuffix("-start")
        if base in COLLECTIVES and not ins.opcode.endswith("-done"):
            biggest = max(ins.arrays, key=lambda a: _bytes([a]))
            key = f"{base} {biggest[0]}[{','.join(map(str, biggest[1]))}]"
            entry = collectives.setdefault(key, {"count": 0, "bytes": 0})
            entry["count"] += times
            entry["bytes"] += times * _bytes([biggest])
        if ins.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]+)"', ins.text)
            calls[target[1] if target else "?"] += times
        if ins.opcode in _PASS_THROUGH:
            continue
        operands = [instructions[o] for o in ins.operands if o in instructions]
        on_host = any(a[2] for a in ins.arrays)
        if on_host:  # a result in host memory: the device operands it reads go out
            to_host += times * sum(_bytes([a for a in o.arrays if not a[2]]) for o in operands)
        elif any(a[2] for o in operands for a in o.arrays):  # a device result from host operands
            to_device += times * _bytes(ins.arrays)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    need = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)
    return {
        "bytes_per_device": {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
                             "aliased": memory.alias_size_in_bytes, "temporaries": memory.temp_size_in_bytes,
                             "code": memory.generated_code_size_in_bytes, "total": need,
                             "host_arguments": memory.host_argument_size_in_bytes,
                             "host_outputs": memory.host_output_size_in_bytes,
                             "host_temporaries": memory.host_temp_size_in_bytes},
        "fits": need <= s.hbm_bytes, "hbm_bytes": s.hbm_bytes,
        "collectives": dict(sorted(collectives.items(), key=lambda kv: -kv[1]["bytes"])),
        "collective_bytes": sum(c["bytes"] for c in collectives.values()),
        "custom_calls": dict(sorted(calls.items())),
        "host_to_device_bytes": int(to_device), "device_to_host_bytes": int(to_host),
        "flops": flops, "bytes_accessed": accessed,
        "roofline_s": max(flops / s.peak_flops, accessed / s.hbm_bandwidth) if cost else None,
    }
