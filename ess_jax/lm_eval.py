"""lm-evaluation-harness's native model ``ess_jax``: its three request types served by one online ``Engine``
(chunked prefill, continuous batching, ESS on unless ``offload=none``), no server between them.

    python -m ess_jax.lm_eval --model ess_jax --model_args model=tiny-v32-code,pool_ratio=0.2 \\
        --tasks hellaswag --batch_size 8

or, in a JAX program, ``lm_eval.simple_evaluate(model=ESSJaxLM(model=...), tasks=[...])`` (importing this
module registers the name ``ess_jax``, so ``simple_evaluate(model="ess_jax", model_args=...)`` works too).
``python -m ess_jax.lm_eval`` is lm-eval's own command line with the model registered: lm-eval 0.4 finds
models only in its registry, which a plain ``lm_eval`` process never imports ``ess_jax`` into.

``model_args`` keys are the model and engine flags of ``python -m ess_jax.generate`` / ``serve`` with ``_``
for ``-`` (``model``, ``dtype``, ``weights``, ``weights_seed``, ``offload``, ``pool_size``, ``pool_ratio``,
``fetch``, ``host_cache_mb``, ``page_size``, ``num_pages``, ``prefill_chunk``, ``kernels``, ``cache_dtype``,
``index_dtype``, ``mesh``, ``compile_cache``), one meaning each, checked as the flags are; and lm-eval's:
``max_length`` (model inputs per request, default min(4096, max_position_embeddings); the engine holds
``max_length + 1`` tokens, the last scored token included), ``max_gen_toks`` (default 256), ``add_bos_token``
(default false, as lm-eval's other models), ``seed`` (the sampled requests' seed, default 1234).
``--batch_size N`` is the engine's decode batch rows (``--max-batch``).

- ``loglikelihood``: ``ess_jax.loglikelihood`` on the model's engine: context + continuation prefilled as one
  prompt whose log-probabilities are computed in the prefill pieces; left-truncated to ``max_length + 1``
  tokens as lm-eval's HF model does (a warning says so).
- ``loglikelihood_rolling``: lm-eval's windows (``utils.get_rolling_token_windows`` with ``max_length``, one
  token of context, ``make_disjoint_window``) after the prefix token (bos, else eos), scored as loglikelihood
  requests, every document's windows batched together.
- ``generate_until``: the context (left-truncated to ``max_length - max_gen_toks`` tokens) generates at most
  ``max_gen_toks`` tokens, ending at eos or before the first ``until`` string (matched on the decoded text,
  cut from the reply). Greedy unless ``do_sample`` is true (as transformers' ``generate``): then
  ``temperature`` (default 1.0), ``top_p``, ``top_k`` apply. Other generation keywords are refused.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

try:
    import lm_eval.models  # noqa: F401  (first: lm-eval imports its own models only into an empty registry)
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:
    MISSING = (f"lm-evaluation-harness is not installed ({e}); install it with pip install 'ess_jax[eval]' "
               "(lm-eval 0.4 and the tokenizer backends its local-completions model uses)")
    TemplateLM = object

    def register_model(*names):
        return lambda cls: cls
else:
    MISSING = None

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 4096
# The flags of ``python -m ess_jax.serve`` a model_args key may not set: lm-eval names these itself.
RENAMED = {"max_batch": "--batch_size", "max_seq_len": "max_length"}
GENERATION_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")


def parse_model_args(args: dict[str, Any]) -> argparse.Namespace:
    """``model_args`` (lm-eval's parsed ``key=value`` pairs) as the CLI's model and engine flags; ValueError
    naming a key that is not one, or a value the flag refuses."""
    from ess_jax.cli import Parser, add_engine_flags, add_model_flag

    class ArgsParser(Parser):
        def error(self, message):
            raise ValueError(f"model_args: {message}; the keys are the flags of python -m ess_jax.serve with _ "
                             f"for - (model, offload, pool_ratio, ...)")

    parser = ArgsParser("ess_jax (lm-eval model_args)", None)
    add_model_flag(parser)
    add_engine_flags(parser)
    argv = []
    for key, value in args.items():
        if key in RENAMED:
            raise ValueError(f"model_args: {key} is lm-eval's {RENAMED[key]} here; set that instead")
        if isinstance(value, bool):
            raise ValueError(f"model_args: {key}={value} is not a value of --{key.replace('_', '-')}")
        argv += [f"--{key.replace('_', '-')}", "none" if value is None else str(value)]
    return parser.parse_args(argv)


@register_model("ess_jax")
class ESSJaxLM(TemplateLM):
    """The ``ess_jax`` model of lm-evaluation-harness (the module's docstring): ``model`` a name or directory
    as ``ess_jax.load_model`` takes, or a loaded ``ess_jax.Model``; the other keywords as ``model_args``."""

    def __init__(self, model: Any = "tiny-v32-code", *, batch_size: int | str = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool = False, seed: int = 1234, device: str | None = None,
                 max_batch_size: int | None = None, **flags):
        if MISSING:
            raise ImportError(MISSING)
        super().__init__()
        from ess_jax.api import Model, load_model
        from ess_jax.cli import engine_config, flags_config
        from ess_jax.config import resolve_model
        from ess_jax.engine import Engine
        from ess_jax.families import source_config

        if device is not None:
            raise ValueError(f"--device {device}: jax chooses the device (JAX_PLATFORMS=cpu|cuda|tpu); drop --device")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1 (the engine's decode batch rows); "
                             "'auto' is not supported")
        loaded = isinstance(model, Model)
        args = parse_model_args({**({} if loaded else {"model": str(model)}), **flags})
        cfg = model.cfg if loaded else source_config(resolve_model(args.model))
        self._max_length = max_length or min(DEFAULT_MAX_LENGTH, cfg.max_position_embeddings)
        if not 1 <= self._max_length < cfg.max_position_embeddings:
            raise ValueError(f"max_length={self._max_length} must be in [1, {cfg.max_position_embeddings}) (the "
                             "engine holds max_length + 1 tokens, at most the model's max_position_embeddings)")
        if isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            raise ValueError(f"max_gen_toks={max_gen_toks!r} must be an integer >= 1")
        sizes = {"max_batch": batch_size, "max_seq_len": self._max_length + 1}
        config = flags_config(args, **sizes) if loaded else engine_config(args, **sizes)
        self.model = model if loaded else load_model(args.model, args.dtype, seed=args.weights_seed,
                                                     weights=args.weights)
        self.engine = Engine(self.model, config)
        self.tokenizer = self.model.tokenizer
        self.max_gen_toks, self.add_bos_token, self.seed = max_gen_toks, add_bos_token, seed

    # ---- what TemplateLM asks -----------------------------------------------------------------
    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def eot_token_id(self) -> int:
        return self.model.cfg.eos_token_id[0]

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: bos, else eos (as lm-eval's HF model)."""
        bos = self.model.cfg.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return self.model.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The tokenizer's ids of ``string``; special tokens (the bos of DeepSeek's post-processor) only with
        ``add_special_tokens``, by default ``add_bos_token``."""
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return self.tokenizer.encode(string, add_special_tokens=special)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(logprob, is_greedy)`` of each ``(cache key, context ids, continuation ids)``; each left-truncated to
        ``max_length + 1`` tokens (with a warning)."""
        from ess_jax.api import loglikelihood

        pairs = []
        limit = self.max_length + 1
        for _, context, continuation in requests:
            if len(continuation) >= limit:
                raise ValueError(f"a continuation of {len(continuation)} tokens leaves no context within "
                                 f"max_length={self.max_length}; raise max_length")
            cut = max(0, len(context) + len(continuation) - limit)
            if cut:
                log.warning("context of %d tokens + continuation of %d exceed max_length + 1 = %d: the context "
                            "is left-truncated", len(context), len(continuation), limit)
            pairs.append((context[cut:], continuation))
        scores = loglikelihood(self.model, pairs, engine=self.engine) if pairs else []
        for (key, _, _), score in zip(requests, scores):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, score)
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(r.args for r in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for r, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from ess_jax.server.stream import StopStrings

        stops, texts = {}, {}
        for context, gen_kwargs in (r.args for r in requests):
            spec, until = self._generation(context, gen_kwargs)
            request_id = self.engine.add_request(spec)
            stops[request_id], texts[request_id] = StopStrings(until), []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id not in stops or stops[out.request_id] is None:
                    continue
                text, stopped = stops[out.request_id].push(out.text_delta, out.finished)
                texts[out.request_id].append(text)
                if stopped or out.finished:
                    stops[out.request_id] = None
                    if not out.finished:
                        self.engine.abort(out.request_id)
        replies = ["".join(texts[i]) for i in sorted(texts)]
        for r, reply in zip(requests, replies):
            self.cache_hook.add_partial("generate_until", r.args, reply)
        return replies

    def _generation(self, context: str, gen_kwargs: dict):
        """A generate_until request as the engine's ``RequestSpec`` and its stop strings."""
        from ess_jax.engine import RequestSpec
        from ess_jax.sampling import SamplingParams

        unknown = sorted(set(gen_kwargs) - set(GENERATION_KEYS))
        if unknown:
            raise ValueError(f"generation keywords {', '.join(unknown)} are not supported by ess_jax; it takes "
                             f"{', '.join(GENERATION_KEYS)}")
        until = gen_kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = gen_kwargs.get("max_gen_toks", self.max_gen_toks)
        if not isinstance(max_new, int) or not 1 <= max_new < self.max_length:
            raise ValueError(f"max_gen_toks={max_new!r} must be an integer in [1, max_length={self.max_length})")
        sampling = SamplingParams(seed=self.seed)
        if gen_kwargs.get("do_sample"):
            sampling = SamplingParams(temperature=float(gen_kwargs.get("temperature", 1.0)),
                                      top_p=float(gen_kwargs.get("top_p", 1.0)), top_k=int(gen_kwargs.get("top_k", 0)),
                                      seed=self.seed)
        prompt = self.tok_encode(context)[-(self.max_length - max_new):] if context else []
        if not prompt:
            prompt = [self.prefix_token_id]
        return RequestSpec(prompt, max_new, sampling), [s for s in until if s]


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line (``lm_eval ...``) with the ``ess_jax`` model registered."""
    if MISSING:
        print(f"error: {MISSING}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [str(Path(sys.argv[0]).name)] + (sys.argv[1:] if argv is None else list(argv))
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
