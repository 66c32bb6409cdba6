"""``python -m ess_jax.export``: the engine's compiled steps lowered for a TPU or an NVIDIA GPU on a machine
without one (DOMAIN.md §7), written as ``jax.export`` artifacts.

    python -m ess_jax.export --platform tpu|cuda [--device-kind KIND] --model NAME|DIR [--num-layers N]
        [the engine flags: --offload, --mesh, --kernels, --max-batch, --max-seq-len, ...] --out DIR

The target is an abstract mesh of ``--mesh``'s shape (one device without it) whose devices are abstract devices
of ``--device-kind`` (default: TPU v6 lite; NVIDIA H200): ``--kernels auto`` chooses for them
(``ops.resolve_kernels``). Every argument is a shape, nothing is allocated, so DeepSeek's full shapes lower here:
the parameters from ``nnx.eval_shape`` in the runner's shardings (``mesh.param_sharding``), the caches from the
engine's cache builders traced (``layout.MODE_SPECS[...].decode_cache``, the ESS prefill scratch) in the runner's
shardings (``mesh.shard_axes``, ``mesh.cache_shardings``), each array in the memory kind its builder gives it (the
ESS host store: ``pinned_host``). The steps are the engine's own, as its catalog declares them (``steps.catalog``):
``decode``, ``prefill_T`` for each piece size T (``plan.piece_sizes``), and with ``--offload ess`` ``handoff``,
``release``, ``flush`` and (with the prefix cache) ``load_prefix``; with the prefix cache on DeepSeek-V4 ``row_state``
and ``resume`` (a prompt's window and rings to a snapshot and back).

``DIR/STEP.jax_export`` holds each step's ``Exported.serialize()`` (``jax.export.deserialize`` reads it back on the
target, whose ``call`` runs it); ``DIR/summary.json`` the target, the kernels used and per step its file, the
custom calls in its program (name: count) and its argument and output bytes per device by memory kind (an
argument without a sharding, the host-made step metadata, counted whole). A step that does not lower for the
target: exit 2, the step, the target and the lowering's message on standard error."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding

from ess_jax import aot, cli, families, mesh, ops
from ess_jax.api import DTYPES
from ess_jax.config import ModelConfig, resolve_model
from ess_jax.engine import steps
from ess_jax.engine.layout import MODE_SPECS, cache_layout, window_shape
from ess_jax.models import quant

PLATFORMS = {"tpu": ("tpu", "TPU v6 lite"), "cuda": ("gpu", "NVIDIA H200")}  # --platform: jax's device platform, kind
GPU_CALLS = ("mosaic_gpu_v2",)  # the Mosaic GPU kernels' custom call: jax.export serializes it only when told to


@dataclasses.dataclass(frozen=True)
class Target:
    """What the steps are lowered (or compiled) for: ``platform`` ("tpu" or "cuda"), the devices' kind, the mesh's
    shape; ``spec``: compiling, the compile-only devices' (``ess_jax.aot``); None: lowering for abstract devices."""

    platform: str
    kind: str
    shape: mesh.MeshShape
    spec: aot.Spec | None = None

    @property
    def mesh(self) -> AbstractMesh | jax.sharding.Mesh:
        """Lowering: an abstract mesh of the target's devices. Compiling: a mesh of its compile-only devices; for
        NVIDIA GPUs, which list no memories (a sharding on them drops ``pinned_host``), a mesh of this machine's CPU
        devices of the same shape instead, the programs traced there and compiled for the GPUs
        (``aot.compile_with_host_memory``)."""
        if self.spec is not None and self.platform == "cuda":
            return _host_mesh(self.shape)
        if self.spec is not None:
            return _compile_mesh(self.spec.name, self.shape)
        device = AbstractDevice(device_kind=self.kind, num_cores=1 if self.platform == "tpu" else None,
                                platform=PLATFORMS[self.platform][0])
        return AbstractMesh(tuple(getattr(self.shape, a) for a in mesh.AXES), mesh.AXES,
                            axis_types=(AxisType.Auto,) * len(mesh.AXES), abstract_device=device)

    @contextlib.contextmanager
    def using(self):
        """The context the steps are traced in: the abstract mesh, or the compile-only devices' mesh (NVIDIA: the CPU
        mesh, with the kernels chosen for the target's devices)."""
        capability = ops.compute_capability("", self.kind) if self.platform == "cuda" else None
        with contextlib.ExitStack() as stack:
            if capability is not None:
                stack.enter_context(mosaic_gpu_arch(capability))
            if self.spec is None:
                stack.enter_context(jax.sharding.use_abstract_mesh(self.mesh))
            elif self.platform == "cuda":
                stack.enter_context(jax.set_mesh(self.mesh))
                stack.enter_context(ops.kernels_for(ops.Device("cuda", self.kind, capability)))
            else:
                stack.enter_context(jax.set_mesh(self.mesh))
            yield

    def __str__(self) -> str:
        name = self.spec.name if self.spec is not None else self.kind
        return f"{name} ({self.platform}, mesh {self.shape})"


@contextlib.contextmanager
def mosaic_gpu_arch(capability: tuple[int, int]):
    """Mosaic GPU lowers its kernels for the architecture of the traced mesh's devices, and for sm_90 when they name
    none (abstract devices, or the CPU devices an NVIDIA target is traced on): an sm_80 kernel so lowered uses
    Hopper-only instructions (``elect.sync``) that the A100's compiler cannot select. Within this context it lowers
    for ``capability``, the target's."""
    from jax.experimental.mosaic.gpu import utils as mosaic_utils

    inferred = mosaic_utils._infer_arch
    mosaic_utils._infer_arch = lambda: capability
    try:
        yield
    finally:
        mosaic_utils._infer_arch = inferred


@functools.cache
def _compile_mesh(target: str, shape: mesh.MeshShape) -> jax.sharding.Mesh:
    return aot.compile_mesh(aot.spec(target), shape)


@functools.cache
def _host_mesh(shape: mesh.MeshShape) -> jax.sharding.Mesh:
    cpus = jax.devices("cpu")
    if len(cpus) < shape.size:
        raise ValueError(f"compiling for {shape.size} NVIDIA GPUs traces on as many CPU devices; this process has "
                         f"{len(cpus)}: set XLA_FLAGS=--xla_force_host_platform_device_count={shape.size}")
    return jax.sharding.Mesh(np.array(cpus[:shape.size]).reshape(tuple(getattr(shape, a) for a in mesh.AXES)),
                             mesh.AXES, axis_types=(AxisType.Auto,) * len(mesh.AXES))


class StepError(Exception):
    """A step that does not lower for the target."""


def shaped(x, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def model_config(name: str, num_layers: int | None) -> ModelConfig:
    """``--model``'s config, cut to its first ``num_layers`` layers when given."""
    raw = resolve_model(name).raw_config()
    return families.load_config(dict(raw, num_hidden_layers=num_layers) if num_layers else raw)


def abstract_cache(make, size: families.CacheSize, config, target: Target):
    """The cache ``make(size)`` as shapes in the shardings the runner commits it to (``Runner.build``), each
    array in the memory kind ``make`` gives it; and the steps' static shardings (None without ``--mesh``)."""
    shapes, shardings = mesh.cache_shardings(make, size, target.mesh)
    cache = jax.tree.map(shaped, shapes, shardings)
    return cache, mesh.Layout.of(shardings) if config.mesh else None


def release_params(cfg: ModelConfig, params: nnx.State) -> nnx.State:
    """``params`` (shapes) as ``weights="release"`` holds them: each parameter the release quantizes
    (``Family.release_bytes``) as its ``quant.Fp8Blocks`` (e4m3 values, 128 x 128 block scales: float32, or ue8m0
    when one byte a block) or ``quant.Fp4Values`` (two e2m1 values a byte, a ue8m0 scale per 32 values)."""
    family = families.get(cfg.family)

    def release(path, x):
        names = mesh.path_names(path)
        names = names[:-1] if names[-1] == "value" else names  # the parameter's path, not its variable's field
        routed = "experts" in names and "shared_experts" not in names
        stored = family.release_bytes(names, routed, tuple(x.shape))
        if stored is None:
            return x
        *lead, out, inp = x.shape
        if stored == math.prod(x.shape) / 2 + math.prod(x.shape) / quant.FP4_GROUP:
            return quant.Fp4Values(jax.ShapeDtypeStruct((*lead, out, inp // 2), jnp.int8),
                                   jax.ShapeDtypeStruct((*lead, out, inp // quant.FP4_GROUP), jnp.float8_e8m0fnu),
                                   dtype=x.dtype)
        parts = 2 if names[-1] == "gate_up_proj" else 1
        blocks = (*lead, parts * math.ceil(out / parts / 128), math.ceil(inp / 128))
        scale_dtype = jnp.float32 if stored - math.prod(x.shape) == 4 * math.prod(blocks) else jnp.float8_e8m0fnu
        return quant.Fp8Blocks(jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
                               jax.ShapeDtypeStruct(blocks, scale_dtype), (128, 128), parts, dtype=x.dtype)

    return jax.tree_util.tree_map_with_path(release, params)


def abstract_engine(cfg: ModelConfig, config, dtype: str, seed: int, target: Target,
                    weights: str = "dequantized") -> steps.EngineArrays:
    """What ``Engine(model, config)`` builds on the target's devices, as shapes (``Runner.arrays``), the parameters
    as ``weights`` keeps them (``release``: the release's quantized bytes)."""
    module = nnx.eval_shape(lambda: families.get(cfg.family).module_cls(cfg, dtype=DTYPES[dtype],
                                                                       rngs=nnx.Rngs(seed)))
    graphdef, params = nnx.split(module)
    if weights == "release":
        params = release_params(cfg, params)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: shaped(x, mesh.param_sharding(target.mesh, mesh.path_names(path), x.shape)), params)
    layout = cache_layout(cfg, config, jnp.dtype(module.dtype).name)
    mode = MODE_SPECS[config.offload]
    cache, shardings = abstract_cache(lambda size: mode.decode_cache(module, size, config, layout), layout.size,
                                      config, target)
    scratch, scratch_shardings = abstract_cache(*mode.prefill_cache(module, config, layout), config, target)
    window = jax.ShapeDtypeStruct(window_shape(steps.Graph(graphdef, config.kernels), nnx.state(module), layout.size),
                                  jnp.int32, sharding=NamedSharding(target.mesh, steps.LAYER_ROWS))
    return steps.EngineArrays(layout, target.mesh, graphdef, params, cache, shardings, scratch, scratch_shardings,
                              window)


def export_step(name: str, step: steps.StepSpec, target: Target) -> jax.export.Exported:
    """``step`` exported for the target over the leaves of its arguments, returning the leaves of its results
    (an artifact a caller feeds from its own pytrees, whatever their types); StepError with the lowering's
    message."""
    leaves, treedef = jax.tree.flatten(step.args)
    flat = jax.jit(lambda *leaves: jax.tree.leaves(step.fn(*step.static, *jax.tree.unflatten(treedef, leaves),
                                                             **step.kwargs)),
                   out_shardings=jax.tree.leaves(step.out))
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in GPU_CALLS] if target.platform == "cuda" else []
    try:
        return jax.export.export(flat, platforms=[target.platform], disabled_checks=checks)(*leaves)
    except Exception as e:  # whatever the lowering raises, reported with the step and the target
        raise StepError(f"the {name} step does not lower for {target}: {type(e).__name__}: {e}") from e


def bytes_per_device(avals, shardings) -> dict[str, int]:
    """Bytes of each memory kind one device holds of arrays ``avals`` in ``shardings`` (None: whole)."""
    total = collections.Counter()
    for aval, sharding in zip(avals, shardings):
        shape = sharding.shard_shape(aval.shape) if sharding is not None else aval.shape
        kind = "pinned_host" if aval.memory_space == jax.memory.Space.Host else "device"
        total[kind] += math.prod(shape) * aval.dtype.itemsize
    return dict(total)


def describe(exported: jax.export.Exported, target: Target) -> dict:
    """The summary of one step: its custom calls (name: count) and bytes per device."""
    calls = collections.Counter(re.findall(r"stablehlo\.custom_call @(\w+)", exported.mlir_module()))
    return {"custom_calls": dict(sorted(calls.items())),
            "argument_bytes_per_device": bytes_per_device(exported.in_avals, exported.in_shardings_jax(target.mesh)),
            "output_bytes_per_device": bytes_per_device(exported.out_avals, exported.out_shardings_jax(target.mesh))}


def export(cfg: ModelConfig, config, dtype: str, seed: int, target: Target, out: Path) -> dict:
    """Every engine step exported for ``target`` into ``out``, and the summary (also ``out/summary.json``)."""
    with target.using():
        kernels = ops.resolve_kernels(config.kernels)
        found = steps.catalog(families.get(cfg.family), config, abstract_engine(cfg, config, dtype, seed, target))
        out.mkdir(parents=True, exist_ok=True)
        summary = {"target": {"platform": target.platform, "device_kind": target.kind, "mesh": str(target.shape),
                              "devices": target.shape.size},
                   "model": {"family": cfg.family, "num_layers": cfg.num_hidden_layers, "dtype": dtype},
                   "engine": dataclasses.asdict(config),
                   "kernels": kernels, "steps": {}}
        for name, step in found.items():
            exported = export_step(name, step, target)
            (out / f"{name}.jax_export").write_bytes(exported.serialize())
            summary["steps"][name] = {"file": f"{name}.jax_export", **describe(exported, target)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def compile_step(name: str, step: steps.StepSpec, target: Target) -> dict:
    """``step`` compiled by the target's own compiler (libtpu with Mosaic TPU; XLA:GPU) as the engine compiles it (its
    own jit: the caches donated, so updated in place), and what the compiled program says (``aot.analyze``); a step
    that does not compile: ``compiled: False`` and the compiler's message."""
    try:
        if target.platform == "cuda":
            compiled = aot.compile_with_host_memory(step.fn, (*step.static, *step.args), target.spec, step.kwargs)
        else:
            compiled = step.lower().compile()
    except Exception as e:  # the compiler's verdict, whatever it raises, is the report
        lines = [line for line in str(e).splitlines() if line.strip()]
        return {"compiled": False, "error": f"{type(e).__name__}: {' '.join(lines[:4])[:1500]}"}
    return {"compiled": True, **aot.analyze(compiled, target.spec)}


def compile_all(cfg: ModelConfig, config, dtype: str, seed: int, target: Target, out: Path | None,
                weights: str = "dequantized", only: list[str] | None = None) -> dict:
    """Every engine step (``only``: those named) compiled for ``target`` (a compile-only ``spec``), the summary
    (also ``out/summary.json`` when ``out`` is given)."""
    with target.using():
        kernels = ops.resolve_kernels(config.kernels)
        found = steps.catalog(families.get(cfg.family), config,
                              abstract_engine(cfg, config, dtype, seed, target, weights))
        if only:
            if unknown := sorted(set(only) - set(found)):
                raise ValueError(f"--steps {','.join(unknown)}: not a step of this engine; its steps are "
                                 f"{', '.join(found)}")
            found = {name: step for name, step in found.items() if name in only}
        summary = {"target": {"name": target.spec.name, "platform": target.platform, "device_kind": target.kind,
                              "mesh": str(target.shape), "devices": target.shape.size,
                              "hbm_bytes": target.spec.hbm_bytes, "hbm_bandwidth": target.spec.hbm_bandwidth,
                              "peak_flops": target.spec.peak_flops},
                   "model": {"family": cfg.family, "num_layers": cfg.num_hidden_layers, "dtype": dtype,
                             "weights": weights},
                   "engine": dataclasses.asdict(config), "kernels": kernels,
                   "steps": {name: compile_step(name, step, target) for name, step in found.items()}}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def failures(summary: dict) -> list[str]:
    """The steps of a compile summary that did not compile or do not fit the device's memory, each in a line."""
    hbm = summary["target"]["hbm_bytes"]
    bad = []
    for name, step in summary["steps"].items():
        if not step["compiled"]:
            bad.append(f"{name}: does not compile: {step['error']}")
        elif not step["fits"]:
            bad.append(f"{name}: needs {step['bytes_per_device']['total'] / aot.GIB:.2f} GiB per device, the device "
                       f"has {hbm / aot.GIB:.2f} GiB")
    return bad


def step_line(name: str, step: dict) -> str:
    if not step["compiled"]:
        return f"{name}: FAILED {step['error']}"
    memory, gib = step["bytes_per_device"], aot.GIB
    collectives = ", ".join(f"{k} x{v['count']}" for k, v in step["collectives"].items()) or "none"
    roofline = f"{step['roofline_s'] * 1e3:.3f} ms" if step["roofline_s"] is not None else "-"
    return (f"{name}: arguments {memory['arguments'] / gib:.2f} GiB, temporaries {memory['temporaries'] / gib:.2f} GiB"
            f"{'' if step['fits'] else ' (DOES NOT FIT)'}; host->device {step['host_to_device_bytes'] / 2**20:.1f} "
            f"MiB, device->host {step['device_to_host_bytes'] / 2**20:.1f} MiB; {step['flops'] / 1e9:.1f} GFLOP, "
            f"roofline {roofline}; custom calls {step['custom_calls'] or 'none'}; collectives {collectives}")


def parse_args(argv: list[str] | None):
    p = cli.Parser("python -m ess_jax.export", __doc__, compile_cache=False)
    p.add_argument("--platform", choices=sorted(PLATFORMS), default=None,
                   help="lowering: the target's platform (with --compile: the --target's)")
    p.add_argument("--device-kind", default=None,
                   help="lowering: the target devices' kind, as jax reports it (default: TPU v6 lite; NVIDIA H200), "
                        "e.g. 'NVIDIA A100', 'TPU v5 lite': --kernels auto chooses for it")
    p.add_argument("--compile", action="store_true",
                   help="compile every step with the --target's own compiler (libtpu / XLA:GPU, no device needed; "
                        "the aot extra) and write summary.json: bytes per device, collectives, custom calls, host "
                        "transfers, FLOPs and the roofline time; exit 2 naming a step that does not compile or fit")
    p.add_argument("--target", choices=sorted(aot.SPECS), default=None,
                   help="with --compile: the device compiled for (TPU v5e / v6e / v5p, NVIDIA H100 / H200 / A100 / "
                        "B200); the mesh's devices are that many of it")
    p.add_argument("--steps", default=None, metavar="NAME,...",
                   help="with --compile: only these steps (e.g. decode,prefill_64); default every step")
    p.add_argument("--num-layers", type=int, default=None, help="the model's first N layers only")
    p.add_argument("--out", type=Path, default=None,
                   help="directory the artifacts and summary.json are written to (required without --compile)")
    cli.add_model_flag(p)
    cli.add_engine_flags(p)
    return p, p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    parser, args = parse_args(argv)
    if args.compile:  # traced on this machine's CPU devices, compiled for compile-only ones: an installed
        jax.config.update("jax_platforms", "cpu")  # accelerator plugin must not become the default backend
    try:
        if args.num_layers is not None and args.num_layers < 1:
            raise ValueError(f"--num-layers {args.num_layers} must be >= 1")
        config = cli.flags_config(args)
        shape = mesh.parse(config.mesh) if config.mesh else mesh.MeshShape()
        cfg = model_config(args.model, args.num_layers)
        if args.compile:
            if args.target is None:
                raise ValueError(f"--compile needs --target, one of {', '.join(aot.SPECS)}")
            spec = aot.spec(args.target)
            target = Target(spec.platform, spec.kind, shape, spec)
            summary = compile_all(cfg, config, args.dtype, args.weights_seed, target, args.out, args.weights,
                                  args.steps.split(",") if args.steps else None)
        else:
            if args.platform is None or args.out is None:
                raise ValueError("lowering needs --platform and --out (or --compile --target NAME)")
            if args.weights != "dequantized":
                raise ValueError("--weights release: lowering writes the dequantized weights' artifacts; compile the "
                                 "release weights with --compile")
            target = Target(args.platform, args.device_kind or PLATFORMS[args.platform][1], shape)
            summary = export(cfg, config, args.dtype, args.weights_seed, target, args.out)
    except (ValueError, StepError) as e:
        parser.error(str(e))
    if args.compile:
        for name, step in summary["steps"].items():
            print(step_line(name, step))
        bad = failures(summary)
        print(f"kernels {summary['kernels']}; {len(summary['steps']) - len(bad)} of {len(summary['steps'])} steps "
              f"compile and fit for {target}" + (f"; summary in {args.out / 'summary.json'}" if args.out else ""))
        if bad:
            print("\n".join(bad), file=sys.stderr)
            sys.exit(2)
        return
    for name, step in summary["steps"].items():
        print(f"{name}: {step['custom_calls']} arguments {step['argument_bytes_per_device']} outputs "
              f"{step['output_bytes_per_device']} bytes per device")
    print(f"kernels {summary['kernels']}; {len(summary['steps'])} steps for {target} in {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
