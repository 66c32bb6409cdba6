"""The server's host-side bounds, measured: a 4K- and a 16K-token reply detokenized one token at a time (the shipped
tiny-v32-code tokenizer, as the server streams), and /health latency on an idle server and while a 12 MB prompt is
tokenized (``python -m ess_jax.serve`` on a real port, with --api-key), then which endpoints answer without the key.

    python tools/server_limits.py   # from the repository root, ~1 min
"""
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

import ess_jax
from ess_jax.tokenizer import IncrementalDetokenizer

model = ess_jax.load_model("tiny-v32-code")
tok = model.tokenizer
text = open("checkpoints/heldout_code.txt").read() * 8
ids = tok.encode(text)
for n in (4096, 16384):
    sub = ids[:n]
    times = []
    for _ in range(3):
        d = IncrementalDetokenizer(tok)
        t0 = time.perf_counter()
        out = "".join(d.push([t], final=i == n - 1) for i, t in enumerate(sub))
        times.append(time.perf_counter() - t0)
    assert out == tok.decode(sub)
    print(f"detokenize {n} tokens one at a time: median {statistics.median(times)*1e3:.1f} ms of 3")

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
srv = subprocess.Popen([sys.executable, "-m", "ess_jax.serve", "--model", "tiny-v32-code", "--port", str(port),
                        "--api-key", "key"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
url = f"http://127.0.0.1:{port}"
try:
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    idle = []
    for _ in range(50):
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        idle.append(time.perf_counter() - start)
        time.sleep(0.02)
    idle.sort()
    print(f"/health idle, 50 polls: median {statistics.median(idle)*1e3:.1f} ms, max {idle[-1]*1e3:.1f} ms")
    words = " ".join(np.random.default_rng(0).choice(["def", "return", "self", "x", "(", ")"], 2_000_000))[:12 << 20]
    result = {}
    sender = threading.Thread(target=lambda: result.update(reply=httpx.post(
        url + "/v1/completions", headers={"Authorization": "Bearer key"}, timeout=600,
        json={"model": "tiny-v32-code", "prompt": words, "max_tokens": 1})))
    t0 = time.perf_counter()
    sender.start()
    waits = []
    while sender.is_alive():
        start = time.perf_counter()
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        waits.append(time.perf_counter() - start)
        time.sleep(0.02)
    sender.join()
    took = time.perf_counter() - t0
    w = sorted(waits)
    print(f"12 MB prompt: answered {result['reply'].status_code} after {took:.2f} s; /health {len(w)} polls meanwhile: "
          f"median {statistics.median(w)*1e3:.1f} ms, p90 {w[int(0.9*len(w))]*1e3:.1f} ms, max {w[-1]*1e3:.1f} ms")
    print("reply:", result["reply"].json()["error"]["message"][:160])
    unauth = {p: httpx.get(url + p).status_code for p in ("/v1/models", "/metrics", "/tokenizer_info")}
    unauth.update({p: httpx.post(url + p, json=b).status_code for p, b in (("/tokenize", {"prompt": "hi"}),
                   ("/detokenize", {"tokens": [1]}))})
    print("without the key:", unauth, "/health:", httpx.get(url + "/health").status_code)
finally:
    srv.terminate()
    srv.wait(30)
