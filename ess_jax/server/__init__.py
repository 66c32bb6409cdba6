"""The OpenAI-compatible HTTP server on the online engine (``python -m ess_jax.serve``).

An engine thread (``ess_jax.engine.loop.EngineLoop``) steps the engine while the handlers, on uvicorn's
event loop, add requests and read their outputs. Endpoints: ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with ``stream``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text), and vLLM's ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``. Errors are
OpenAI's error JSON.

Modules: ``protocol`` (bodies, errors), ``stream`` (one request's pieces, stop strings), ``context`` (what the
handlers share, the checks before queueing), ``completions``, ``chat``, ``tokenization`` (the handlers: plain
functions of a ``ServeContext`` and a body), ``metrics`` (Prometheus), ``app`` (the FastAPI wiring).
"""

from ess_jax.server.app import create_app

__all__ = ["create_app"]
