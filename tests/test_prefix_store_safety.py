"""The prefix cache's disk store under hostile or failing disks (ess_jax.prefix_store): only regular files it wrote are
read (symlinks, FIFOs, devices, directories named like files, foreign files left alone), planted temporaries never
written through, a second process only reads, the first I/O error turns the store off with one log line; and on the
engine, pages of other weights (a checkpoint saved over in place, another seed) never read, a removed directory
leaving the engine serving the tokens of no prefix cache."""

import dataclasses
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy
from flax import nnx

import ess_jax
from ess_jax.api import Model
from ess_jax.engine import Engine, RequestSpec
from ess_jax.prefix_store import SUBDIR, PrefixStore, encode, signature
from helpers import ENGINE

FIXTURE = Path(__file__).parent / "fixtures" / "hf-v32-a"
SALT = b"salt"
KEYS = [bytes([i]) * 16 for i in range(4)]


def arrays(seed: int = 0) -> list[np.ndarray]:
    return [np.random.default_rng(seed).normal(size=(2, 8)).astype(np.float32)]


SPEC = signature(arrays())


def name(key: bytes) -> str:
    return key.hex() + ".page"


def test_only_regular_files_it_wrote_are_listed_and_read(tmp_path, caplog):
    directory = tmp_path / SUBDIR
    PrefixStore(tmp_path, 1 << 20, SALT)
    outside = tmp_path / "outside.page"
    outside.write_bytes(encode(arrays(), KEYS[0], SALT))  # a valid file, outside the store
    (directory / name(KEYS[0])).symlink_to(outside)
    (directory / name(KEYS[1])).symlink_to(tmp_path / "missing")  # dangling
    (directory / name(KEYS[2])).mkdir()  # a directory named like a page
    os.mkfifo(directory / name(KEYS[3]))
    (tmp_path / "experiment.state").write_bytes(b"a user's file")  # beside the store, not in it
    planted = directory / f".{name(KEYS[0])}.{os.getpid()}.1.tmp"
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    planted.symlink_to(victim)
    store = PrefixStore(tmp_path, 1 << 20, SALT)
    assert store.enabled and store.bytes == 0 and not any(store.has(k) for k in KEYS)
    assert not planted.is_symlink() and victim.read_bytes() == b"keep"  # stale temporaries removed, not followed
    store.put(KEYS[0], ".page", arrays())
    store.flush()
    assert victim.read_bytes() == b"keep" and (tmp_path / "experiment.state").exists()
    assert [a.tolist() for a in store.get(KEYS[0], ".page", SPEC)] == [a.tolist() for a in arrays()]
    # swapped after it was listed: a FIFO (the read must not block), a symlink to a device, a bogus dtype
    swaps = {"fifo": lambda p: os.mkfifo(p), "device": lambda p: p.symlink_to("/dev/zero"),
             "dtype": lambda p: p.write_bytes(encode(arrays(), KEYS[0], SALT).replace(b"<f4", b"|O"))}
    for what, swap in swaps.items():
        store.put(KEYS[0], ".page", arrays())
        store.flush()
        path = directory / name(KEYS[0])
        path.unlink(missing_ok=True)
        swap(path)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ess_jax.prefix_store"):
            assert store.get(KEYS[0], ".page", SPEC) is None, what
        assert "unreadable" in caplog.text and store.enabled, what
        path.unlink(missing_ok=True)


def test_a_second_process_on_the_directory_only_reads(tmp_path):
    store = PrefixStore(tmp_path, 1 << 20, SALT)
    store.put(KEYS[0], ".page", arrays())
    store.flush()
    code = ("import sys, numpy as np; from ess_jax.prefix_store import PrefixStore, signature\n"
            f"s = PrefixStore(sys.argv[1], 1 << 20, {SALT!r})\n"
            f"got = s.get({KEYS[0]!r}, '.page', signature([np.zeros((2, 8), np.float32)]))\n"
            f"s.put({KEYS[1]!r}, '.page', [np.zeros((2, 8), np.float32)]); s.flush()\n"
            "print(s.writable, got is not None, s.has(" f"{KEYS[1]!r}))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["False", "True", "False"], run.stderr[-2000:]
    assert "only reads it" in run.stderr


def test_the_first_io_error_turns_the_store_off_with_one_log_line(tmp_path, caplog):
    store = PrefixStore(tmp_path, 1 << 20, SALT)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, limits[1]))  # a disk that takes 16 bytes a file: EFBIG
    try:
        with caplog.at_level(logging.ERROR, logger="ess_jax.prefix_store"):
            store.put(KEYS[0], ".page", arrays())
            store.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert not store.enabled and caplog.text.count("it is off") == 1
    assert not list((tmp_path / SUBDIR).glob(".*.tmp"))  # the failed write's temporary removed
    store.put(KEYS[1], ".page", arrays())
    store.flush()
    assert not store.has(KEYS[1]) and store.get(KEYS[0], ".page", SPEC) is None
    (tmp_path / "file").write_bytes(b"")
    assert not PrefixStore(tmp_path / "file", 1 << 20, SALT).enabled  # a path that is no directory: off, no raise


def serve(model, config, prompts) -> tuple[list[list[int]], int]:
    engine = Engine(model, config)
    tokens = []
    for p in prompts:
        engine.add_request(RequestSpec(p, 4))
        tokens.append(engine.run()[0].output_ids)
    return tokens, (engine.prefix_cache_metrics() or {"per_tier": {"disk": 0}})["per_tier"]["disk"]


def test_pages_of_other_weights_are_never_read_and_a_removed_directory_leaves_the_engine_serving(tmp_path, caplog):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, checkpoint)
    config = dataclasses.replace(ENGINE, prefix_cache_dir=str(tmp_path / "cache"))
    off = dataclasses.replace(ENGINE, prefix_cache=False)
    prompts = [np.random.default_rng(5).integers(0, 256, 40).tolist()]
    model = ess_jax.load_model(checkpoint)
    want, _ = serve(model, off, prompts)
    assert serve(model, config, prompts) == (want, 0)
    assert serve(model, config, prompts) == (want, 32)  # the disk store serves the same weights
    # the checkpoint saved over in place with other weights: the same path, sizes and header
    tensors = safetensors.numpy.load_file(checkpoint / "model.safetensors")
    time.sleep(0.01)
    safetensors.numpy.save_file({k: v * 1.5 if v.dtype.kind == "f" else v for k, v in tensors.items()},
                                checkpoint / "model.safetensors")
    model = ess_jax.load_model(checkpoint)
    want, _ = serve(model, off, prompts)
    assert serve(model, config, prompts) == (want, 0)
    # models of one preset's name and two seeds: their parameters' values name them
    shutil.rmtree(tmp_path / "cache")
    models = [Model("tiny-v32", nnx.merge(model.graphdef, jax.tree.map(lambda x: x * scale, model.params)),
                    model.tokenizer) for scale in (1.0, 0.5)]
    assert serve(models[0], config, prompts)[1] == 0 and serve(models[0], config, prompts)[1] == 32
    want, _ = serve(models[1], off, prompts)
    assert serve(models[1], config, prompts) == (want, 0)
    # the directory removed under a running engine: one error logged, the store off, the tokens right
    prompts.append(prompts[0][::-1])
    want, _ = serve(model, off, prompts)
    engine = Engine(model, config)
    shutil.rmtree(tmp_path / "cache")
    with caplog.at_level(logging.ERROR, logger="ess_jax.prefix_store"):
        for p, tokens in zip(prompts, want):
            engine.add_request(RequestSpec(p, 4))
            assert engine.run()[0].output_ids == tokens
    assert not engine.scheduler.prefix.disk.store.enabled and caplog.text.count("it is off") == 1
