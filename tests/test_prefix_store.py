"""The prefix cache's disk store (ess_jax.prefix_store): checksummed files written atomically, bounded least recently
used first, a missing, truncated, resized or corrupted file a logged miss; on the engine, a restart on the same
directory reading a prompt's pages (and V4's snapshot) back with the tokens of no prefix cache, and a real server
restarted on it hitting on a prompt it served before."""

import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

import ess_jax
from ess_jax.allocator import page_keys
from ess_jax.engine import Engine, RequestSpec
from ess_jax.prefix_store import SUBDIR, PrefixStore, decode, encode, signature
from helpers import ONLINE, free_port, outputs, spawn

FIXTURES = Path(__file__).parent / "fixtures"
KEY = bytes(range(16))
SALT = b"salt"


def arrays(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(2, 4, 3)).astype(np.float32), rng.integers(0, 255, (2, 4, 5)).astype(np.uint8)]


def test_a_file_round_trips_and_every_damage_is_named():
    data = encode(arrays(), KEY, SALT)
    assert [a.tolist() for a in decode(data, KEY, SALT)] == [a.tolist() for a in arrays()]
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    for bad, message in ((bytes(flipped), "checksum"), (data[:-40], "checksum"), (b"garbage", "not a prefix-cache"),
                         (data[:10], "not a prefix-cache")):
        with pytest.raises(ValueError, match=message):
            decode(bad, KEY, SALT)
    with pytest.raises(ValueError, match="another model"):  # renamed from another engine's store
        decode(data, KEY, b"other")
    with pytest.raises(ValueError, match="holds page"):  # renamed from another key
        decode(data, bytes(16), SALT)


def test_store_reads_back_across_instances_and_treats_bad_files_as_logged_misses(tmp_path, caplog):
    store = PrefixStore(tmp_path, 1 << 20, SALT)
    store.put(KEY, ".page", arrays())
    store.flush()
    directory = tmp_path / SUBDIR
    assert not list(directory.glob(".*.tmp"))  # written to a temporary name, then renamed
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert oct((directory / (KEY.hex() + ".page")).stat().st_mode & 0o777) == "0o600"
    again = PrefixStore(tmp_path, 1 << 20, SALT)  # a restart: the files an earlier run left
    got = again.get(KEY, ".page", signature(arrays()))
    assert [a.tolist() for a in got] == [a.tolist() for a in arrays()]
    assert again.get(KEY, ".state", signature(arrays())) is None  # absent: a miss, nothing logged
    assert again.get(KEY, ".page", signature(arrays(1)[:1])) is None  # arrays the engine does not read: bad
    path = directory / (KEY.hex() + ".page")
    assert not path.exists() and "the engine reads" in caplog.text
    good = encode(arrays(), KEY, SALT)
    damaged = {"bit flip": bytes([good[0] ^ 1]) + good[1:], "truncated": good[:len(good) // 2],
               "wrong size": good + b"\0" * 8, "another salt": encode(arrays(), KEY, b"other")}
    for what, data in damaged.items():
        caplog.clear()
        path.write_bytes(data)
        store = PrefixStore(tmp_path, 1 << 20, SALT)
        with caplog.at_level(logging.WARNING, logger="ess_jax.prefix_store"):
            assert store.get(KEY, ".page", signature(arrays())) is None, what
        assert str(path) in caplog.text and "unreadable" in caplog.text, what
        assert not path.exists() and store.bytes == 0, what


def test_store_is_bounded_least_recently_used_first(tmp_path):
    size = len(encode(arrays(), KEY, SALT))
    store = PrefixStore(tmp_path, 3 * size, SALT)
    keys = [bytes([i]) * 16 for i in range(4)]
    for key in keys[:3]:
        store.put(key, ".page", arrays())
    store.flush()
    assert store.get(keys[0], ".page", signature(arrays())) is not None  # read: the most recently used now
    store.put(keys[3], ".page", arrays())  # the least recently used (keys[1]) goes
    store.flush()
    assert [store.has(k) for k in keys] == [True, False, True, True]
    assert store.bytes == 3 * size == sum(p.stat().st_size for p in (tmp_path / SUBDIR).glob("*.page"))
    store.put(b"\xff" * 16, ".page", [np.zeros(4 * size, np.uint8)])  # larger than the bound: not stored
    store.flush()
    assert not store.has(b"\xff" * 16) and store.bytes == 3 * size
    with pytest.raises(ValueError, match="prefix-cache-disk-gb"):
        PrefixStore(tmp_path, 0, SALT)


@pytest.mark.parametrize("family, mode", [("v4", "resident"), ("v32", "ess")])
def test_an_engine_restarted_on_the_directory_reads_its_prefixes_back(tmp_path, caplog, family, mode):
    """Prompts served, then served by a new engine on the same directory (nothing in memory): the pages before each
    prompt's boundary (V4: and the snapshot there) come from the disk store, the tokens those of no prefix cache;
    then with one file of each kind damaged: logged, recomputed, the same tokens."""
    model = ess_jax.load_model(FIXTURES / f"hf-{family}-a")
    config = dataclasses.replace(ONLINE[mode], prefix_cache_dir=str(tmp_path))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (90, 75)]

    def serve(config):
        engine = Engine(model, config)
        tokens = []
        for p in prompts:
            engine.add_request(RequestSpec(p, 6))
            tokens.append(engine.run()[0].output_ids)
        return tokens, engine

    want, _ = serve(dataclasses.replace(config, prefix_cache=False, prefix_cache_dir=None))
    tokens, engine = serve(config)
    assert tokens == want and engine.prefix_cache_metrics()["per_tier"]["disk"] == 0
    # the boundaries: resident (90 - 1) and (75 - 1) // 16 * 16; ESS (90 - 32) and (75 - 32) // 16 * 16
    hits = {"resident": (80, 64), "ess": (48, 32)}[mode]
    tokens, engine = serve(config)
    metrics = engine.prefix_cache_metrics()
    assert tokens == want and metrics["per_tier"]["disk"] == metrics["hit_tokens"] == sum(hits)
    # the first prompt's first page truncated; with V4 the second's snapshot with a bit flipped
    keys = [page_keys(p, 16, engine.scheduler.prefix.salt) for p in prompts]
    page = tmp_path / SUBDIR / (keys[0][0].hex() + ".page")
    page.write_bytes(page.read_bytes()[:-3])
    if family == "v4":
        state = tmp_path / SUBDIR / (keys[1][hits[1] // 16 - 1].hex() + ".state")
        state.write_bytes(bytes([state.read_bytes()[0] ^ 4]) + state.read_bytes()[1:])
    with caplog.at_level(logging.WARNING, logger="ess_jax.prefix_store"):
        tokens, engine = serve(config)
    assert tokens == want
    assert str(page) in caplog.text and (family != "v4" or str(state) in caplog.text)
    # V4: the second prompt resumes from the landmark snapshot before its damaged boundary one (``prefix``)
    landmark = {"resident": 48, "ess": 16}[mode]
    assert engine.prefix_cache_metrics()["per_tier"]["disk"] == (landmark if family == "v4" else hits[1])


def test_a_server_restarted_on_the_directory_hits_on_a_prompt_it_served_before(tmp_path):
    """``python -m ess_jax.serve --prefix-cache-dir DIR``: a prompt served, the server stopped (SIGTERM) and started
    again on DIR: the same completion, its prefix read from the disk store (``/metrics``: hits of tier "disk"). The
    server has ``ONLINE["ess"]``'s shapes, so it reads the steps the other modules' engines compiled from the session's
    compilation cache."""
    fixture, shape = FIXTURES / "hf-v4-a", ONLINE["ess"]
    prompt = np.random.default_rng(8).integers(0, 256, 80).tolist()

    def run_once() -> tuple[str, float]:
        port = free_port()
        (proc,) = spawn([[sys.executable, "-m", "ess_jax.serve", "--model", str(fixture), "--port", str(port),
                          "--max-batch", str(shape.max_batch), "--page-size", str(shape.page_size), "--prefill-chunk",
                          str(shape.prefill_chunk), "--prefill-piece-ratio", str(shape.prefill_piece_ratio),
                          "--max-seq-len", str(shape.max_seq_len), "--pool-size", str(shape.pool_size),
                          "--prefix-cache-dir", str(tmp_path), "--served-model-name", "m"]], devices=1)
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
                "model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            disk = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith('ess_jax_prefix_cache_hits_total{tier="disk"}'))
            proc.send_signal(signal.SIGTERM)
        except BaseException:
            proc.kill()
            raise
        outputs([proc], timeout=120)
        return reply.json()["choices"][0]["text"], disk

    first, first_disk = run_once()
    assert first_disk == 0 and any(p.suffix == ".state" for p in (tmp_path / SUBDIR).iterdir())
    again, again_disk = run_once()
    assert again == first and again_disk == (len(prompt) - 32) // 16 * 16  # serve's default offload: ESS
