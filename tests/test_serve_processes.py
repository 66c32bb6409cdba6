"""``python -m ess_jax.serve`` over two real processes of 4 simulated CPU devices each (jax.distributed on
127.0.0.1, gloo collectives), a data=2,expert=4 mesh over all 8: process 0 serves HTTP and its engine ticks'
adds and aborts reach process 1, whose engine steps with it. Replies equal one process's greedy tokens, with
requests arriving together, one client going away mid-stream, and a request after it; SIGTERM to process 0 ends
both with exit code 0."""

import concurrent.futures
import contextlib
import signal
import sys
import time
from pathlib import Path

import httpx

import ess_jax
from ess_jax.engine import EngineConfig
from helpers import free_port, outputs, spawn

FIXTURES = Path(__file__).parent / "fixtures"
DEADLINE = 300
# ESS with a pool smaller than a request (the tier fetches from the host store), two batch rows per data shard
CONFIG = EngineConfig(max_batch=4, page_size=8, prefill_chunk=16, prefill_piece_ratio=16, max_seq_len=64, offload="ess",
                      pool_size=17)
FLAGS = ["--max-batch", "4", "--page-size", "8", "--prefill-chunk", "16", "--prefill-piece-ratio", "16",
         "--max-seq-len", "64", "--offload", "ess", "--pool-size", "17", "--compile-cache", "none",
         "--served-model-name", "m"]
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [7 * i % 256 for i in range(32)], [2, 7, 1, 8, 2, 8, 1, 8]]


def test_two_processes_serve_one_process_tokens():
    fixture = FIXTURES / "hf-v32-a"
    model = ess_jax.load_model(fixture)
    expected = ess_jax.generate(model, [*PROMPTS, PROMPTS[0]], 8, ignore_eos=True, engine=CONFIG).texts
    port = free_port()
    command = [sys.executable, "-m", "ess_jax.serve", "--model", str(fixture), *FLAGS, "--port", str(port),
               "--mesh", "data=2,expert=4", "--num-processes", "2", "--coordinator", f"127.0.0.1:{free_port()}"]
    procs = spawn([[*command, "--process-id", str(i)] for i in range(2)])
    url = f"http://127.0.0.1:{port}/v1/completions"

    def complete(prompt):
        reply = httpx.post(url, timeout=DEADLINE, json={"model": "m", "prompt": prompt, "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"], reply.json()["usage"]["completion_tokens"]

    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            for p in procs:
                assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            time.sleep(0.2)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            together = pool.map(complete, PROMPTS)
            # a client that reads two chunks and goes away: both processes abort its request at the same tick
            with httpx.stream("POST", url, timeout=DEADLINE,
                              json={"model": "m", "prompt": PROMPTS[1], "max_tokens": 32, "stream": True,
                                    "temperature": 0, "ignore_eos": True}) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ") and next(line for line in lines if line)
            assert list(together) == [(text, 8) for text in expected[:3]]
        assert complete(PROMPTS[0]) == (expected[3], 8)
        procs[0].send_signal(signal.SIGTERM)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    assert outputs(procs, timeout=120)[1] == ""  # process 0 alone speaks
