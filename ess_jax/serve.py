"""``python -m ess_jax.serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on the online engine.

Examples:
    python -m ess_jax.serve                                   # tiny-v32-code, ESS at ratio 0.2, 127.0.0.1:8000
    python -m ess_jax.serve --model path/to/ckpt --port 8080 --api-key secret --offload none
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-v32-code", "prompt": "Hello", "max_tokens": 16, "temperature": 0}'

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true), GET /v1/models,
GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's).
SIGINT / SIGTERM: stop accepting, let running requests finish
for up to --shutdown-timeout seconds, abort the rest, exit 0. Bad flags, models or checkpoints print
one line starting with "error:" and exit with 2.

Several processes (``--num-processes``, as for generate; ``--mesh`` spans their devices): run the same
command in each. Process 0 serves HTTP and sends each engine tick's adds and aborts to the others, whose
engines step with it (``ess_jax.engine.loop.follow``); they ignore SIGINT / SIGTERM and exit 0 when process 0
stops:
    python -m ess_jax.serve --mesh data=2,expert=4 --num-processes 2 --process-id 0 --coordinator 127.0.0.1:1234
    python -m ess_jax.serve --mesh data=2,expert=4 --num-processes 2 --process-id 1 --coordinator 127.0.0.1:1234
"""

from __future__ import annotations

import argparse
import signal
import sys

from ess_jax.cli import (Parser, add_engine_flags, add_index_share_flag, add_model_flag, add_process_flags,
                         engine_config, start_processes)

DEFAULT_MAX_SEQ_LEN = 4096


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser("python -m ess_jax.serve", __doc__)
    add_model_flag(p)
    add_index_share_flag(p)
    add_engine_flags(p)
    add_process_flags(p)
    http = p.add_argument_group("HTTP (process 0)")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    http.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: no key)")
    http.add_argument("--max-body-mb", type=float, default=64.0,
                      help="the largest request body in MiB; larger ones get 413 (default 64)")
    http.add_argument("--chat-template", default=None, metavar="FILE",
                      help="a jinja2 chat template for /v1/chat/completions and /tokenize (default: the "
                           "checkpoint's tokenizer_config.json chat_template)")
    http.add_argument("--served-model-name", default=None,
                      help="the model id clients send and /v1/models lists (default: --model as given)")
    http.add_argument("--max-waiting", type=int, default=64,
                      help="requests allowed to wait for a batch row; more get 503 with Retry-After (default 64)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0,
                      help="seconds running requests may take to finish after SIGINT / SIGTERM (default 30)")
    http.add_argument("--metrics-interval", type=int, default=16,
                      help="engine steps between reads of the device counters behind /metrics (default 16)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        for name in ("port", "max_waiting", "metrics_interval"):
            if getattr(args, name) < (0 if name == "port" else 1):
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= "
                                 f"{0 if name == 'port' else 1}")
        if not args.max_body_mb > 0:
            raise ValueError(f"--max-body-mb {args.max_body_mb} must be > 0")
        if args.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0")
        processes = start_processes(args)
        import uvicorn

        from ess_jax.api import load_model
        from ess_jax.engine import Engine
        from ess_jax.engine.loop import follow
        from ess_jax.server import create_app
        from ess_jax.tokenizer import read_chat_template

        model = load_model(args.model, args.dtype, seed=args.weights_seed, weights=args.weights,
                           mesh=args.mesh, index_share=args.index_share)
        template = model.chat_template if args.chat_template is None else read_chat_template(
            args.chat_template, model.tokenizer, model.cfg, model.chat_template)
        config = engine_config(args, max_seq_len=args.max_seq_len or min(DEFAULT_MAX_SEQ_LEN,
                                                                          model.cfg.max_position_embeddings))
        engine = Engine(model, config)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if processes.index:  # process 0's shutdown ends this one
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        follow(engine, metrics_every=args.metrics_interval)
        return 0
    name = args.served_model_name or args.model
    app = create_app(engine, model_name=name, chat_template=template, api_key=args.api_key,
                     max_waiting=args.max_waiting, metrics_every=args.metrics_interval,
                     max_body_bytes=int(args.max_body_mb * 2**20))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    print(f"ess_jax: serving {name!r} ({model.cfg.family}, offload {config.offload}) on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    # uvicorn handles SIGINT / SIGTERM while it serves (graceful shutdown), then raises the signal again under
    # the handlers it found; these make that a no-op, so a requested shutdown exits 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    if not server.started:  # uvicorn logged why (the port is taken, say)
        print(f"error: the server did not start on {args.host}:{args.port}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
