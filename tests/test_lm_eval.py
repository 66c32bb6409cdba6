"""lm-evaluation-harness itself (``lm_eval.simple_evaluate``) on three small local tasks over held-out code (a
multiple-choice, a rolling-perplexity and a generate-until task, their YAMLs and JSON lines written here),
run against ``python -m ess_jax.serve`` on a free 127.0.0.1 port through ``local-completions`` (both tokenizer
backends) and as the native ``ess_jax`` model. Every score is checked against a NumPy log-softmax of the full
causal forward (``Model.logits``) on ids from transformers' tokenizer of the checkpoint, the server's and the
native model's against each other, one document against ``python -m ess_jax.eval``, and the multiple-choice
accuracy against chance (the silent failure of a server whose echoed log-probabilities are wrong)."""

import contextlib
import json
import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import httpx
import numpy as np
import pytest

import ess_jax
from ess_jax.config import resolve_model
from ess_jax.families import source_config
from ess_jax.tokenizer import load_tokenizer
from helpers import free_port

needs_lm_eval = pytest.mark.skipif(find_spec("lm_eval") is None, reason="lm-eval is not installed (ess_jax[eval])")

HELDOUT = Path(__file__).parents[1] / "checkpoints" / "heldout_code.txt"
TASKS = ["heldout_next_line", "heldout_rolling", "heldout_generate"]
MAX_LENGTH = 126  # the native model's inputs per request: rolling documents span several windows
# the native model's engine (ESS, pool ratio 0.2)
SHAPE = {"batch_size": 4, "page_size": 16, "prefill_chunk": 32, "prefill_piece_ratio": 32}
# local-completions reserves a token for its max_tokens=1 and another for the rolling windows' context: with
# max_length = MAX_LENGTH + 2 its windows are the native model's; the server holds max_tokens=1 beyond them.
SERVE = ["--max-batch", "4", "--page-size", "16", "--prefill-chunk", "32", "--prefill-piece-ratio", "32",
         "--max-seq-len", str(MAX_LENGTH + 2)]
GEN_TOKENS = 24
DEADLINE = 600


def heldout_tasks(root: Path, items: int = 20, docs: int = 3, prompts: int = 5) -> None:
    """The three tasks' YAMLs and data under ``root``, from held-out ``csv.py`` (multiple choice, generation)
    and ``fractions.py`` (rolling). Multiple choice: four lines of code, then its real next line against
    three copies of that line with the words shuffled (the same bytes out of order: a working model prefers
    the real one almost always, a scorer whose log-probabilities mean nothing is at chance, 1/4), the gold
    choice's position cycling through the four. Generation: four lines and the first half of the next line's
    words, to complete up to the newline. Rolling: documents of 10, 40 and 60 lines (one window, then several)."""
    lines = HELDOUT.read_text().splitlines()
    split = next(i for i, line in enumerate(lines) if line.startswith("# file: fractions.py"))
    csv_code, fractions = lines[66:split], lines[split + 1:]  # csv.py past its module docstring
    rng = np.random.default_rng(0)
    usable = [i for i in range(4, len(csv_code)) if len(set(csv_code[i].split())) >= 3
              and not csv_code[i].lstrip().startswith("#") and len("\n".join(csv_code[i - 4:i + 1])) < 240]
    picks = sorted(rng.choice(usable, items + prompts, replace=False))
    mc, gen = [], []
    for n, i in enumerate(picks):
        context, line = "\n".join(csv_code[i - 4:i]) + "\n", csv_code[i]
        indent, words = line[: len(line) - len(line.lstrip())], line.split()
        if n % 5 == 4:
            half = len(words) // 2
            gen.append({"context": context + indent + " ".join(words[:half]), "target": " " + " ".join(words[half:])})
            continue
        shuffled = set()
        while len(shuffled) < 3:
            order = list(rng.permutation(words))
            if order != words:
                shuffled.add(indent + " ".join(order))
        gold = len(mc) % 4
        choices = sorted(shuffled)
        mc.append({"context": context, "choices": choices[:gold] + [line] + choices[gold:], "gold": gold})
    rolling = [{"text": "\n".join(fractions[100 * k: 100 * k + n])} for k, n in enumerate([10, 40, 60][:docs])]
    for name, rows in (("mc", mc), ("gen", gen), ("rolling", rolling)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def task(name: str, data: str, body: str) -> None:
        (root / f"{data}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / data}.jsonl\n"
            f"test_split: test\n{body}")

    task(TASKS[0], "mc", 'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
                         'doc_to_target: "{{gold}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n')
    task(TASKS[1], "rolling", 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
                              'metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n')
    task(TASKS[2], "gen", 'output_type: generate_until\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\n'
                          f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n'
                          'metric_list:\n  - metric: exact_match\n')


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The tasks' directory, with the datasets library offline and its cache in a temporary directory."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    heldout_tasks(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(root / "datasets"))
        yield root


def evaluate(tasks: Path, model, names: list[str] = TASKS, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # only the tasks under ``tasks``: indexing lm-eval's thousands of built-in task YAMLs takes ~20 s a call
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=names, task_manager=manager, log_samples=True,
                                   bootstrap_iters=0, **kwargs)


def responses(result: dict) -> dict:
    """Per task, per document (in doc_id order) what the model answered: the multiple-choice task's
    ``(logprob, is_greedy)`` per choice, the rolling task's log-likelihood, the generated text."""
    out = {}
    for task in result["samples"]:
        samples = sorted(result["samples"][task], key=lambda s: s["doc_id"])
        if task == TASKS[0]:
            out[task] = [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in samples]
        elif task == TASKS[1]:
            out[task] = [float(s["resps"][0][0]) for s in samples]
        else:
            out[task] = [s["resps"][0][0] for s in samples]
    return out


@pytest.fixture(scope="module")
def v32():
    return ess_jax.load_model("tiny-v32-code")


@pytest.fixture(scope="module")
def native(tasks, v32, server):
    """The native model's answers (and lm-eval's results) on the three tasks. Its engine has the server's shapes
    (8 pages of 16 tokens a row), so it reads the steps the server's warm-up compiled from the session's
    compilation cache instead of compiling them again."""
    from ess_jax.lm_eval import ESSJaxLM

    result = evaluate(tasks, ESSJaxLM(model=v32, max_length=MAX_LENGTH, **SHAPE))
    return responses(result), result


@pytest.fixture(scope="module")
def server(tasks):
    """``python -m ess_jax.serve`` (tiny-v32-code, ESS) on a free port: its base URL once it answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ess_jax.serve", "--model", "tiny-v32-code", "--port", str(port),
                             *SERVE], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.communicate(timeout=120)


@pytest.fixture(scope="module")
def served(tasks, server):
    """local-completions' answers against the server, by tokenizer backend (each run on first use)."""
    runs = {}

    def run(backend: str) -> dict:
        if backend not in runs:
            args = {"model": "tiny-v32-code", "base_url": server + "/v1/completions", "tokenizer_backend": backend,
                    "max_length": MAX_LENGTH + 2, "max_gen_toks": GEN_TOKENS}
            if backend == "huggingface":
                args["tokenizer"] = str(resolve_model("tiny-v32-code").checkpoint)
            else:  # lm-eval reads the remote bos id 0 as no bos and would start documents with eos instead
                args["custom_prefix_token_id"] = 0
            runs[backend] = responses(evaluate(tasks, "local-completions", model_args=args, batch_size=16))
        return runs[backend]

    return run


def hf_tokenizer(name: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(resolve_model(name).checkpoint))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def reference_scores(model, pairs: list[tuple[list[int], list[int]]], length: int) -> list[tuple[float, bool]]:
    """Each continuation's summed log-probability after its context and whether each of its tokens is the
    argmax, from the full causal forward (rows padded to ``length``: one compile)."""
    out = []
    for context, continuation in pairs:
        ids = context + continuation
        logprobs = log_softmax(model.logits([ids + [0] * (length - len(ids))])[0][len(context) - 1: len(ids) - 1])
        rows = np.arange(len(continuation))
        out.append((float(logprobs[rows, continuation].sum()), bool((logprobs.argmax(-1) == continuation).all())))
    return out


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal ``_encode_pair``: trailing whitespace of the context moved to the continuation, the
    continuation's ids those of the whole past the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    context_ids = tokenizer(context, add_special_tokens=False).input_ids
    return context_ids, whole[len(context_ids):]


def rolling_pairs(tokenizer, text: str, max_length: int) -> list[tuple[list[int], list[int]]]:
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    return [make_disjoint_window(w) for w in get_rolling_token_windows(
        tokenizer(text, add_special_tokens=False).input_ids, tokenizer.bos_token_id, max_length, 1)]


def greedy_text(model, tokenizer, context: str, length: int) -> str:
    """``GEN_TOKENS`` greedy tokens after ``context`` by the full forward, stopped at eos, cut at a newline."""
    ids = tokenizer(context, add_special_tokens=False).input_ids
    out = []
    while len(out) < GEN_TOKENS:
        row = ids + out
        token = int(model.logits([row + [0] * (length - len(row))])[0, len(row) - 1].argmax())
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
    return tokenizer.decode(out, skip_special_tokens=True).split("\n")[0]


def reference(tasks: Path, model, name: str, max_length: int, items: int | None = None) -> dict:
    """What every task's documents score by the full forward, as ``responses`` gives them."""
    tokenizer = hf_tokenizer(name)
    rows = [[json.loads(line) for line in (tasks / f"{data}.jsonl").read_text().splitlines()][:items]
            for data in ("mc", "rolling", "gen")]
    length = max_length + 1
    mc = [reference_scores(model, [encode_pair(tokenizer, d["context"], c) for c in d["choices"]], length)
          for d in rows[0]]
    rolling = [sum(s for s, _ in reference_scores(model, rolling_pairs(tokenizer, d["text"], max_length), length))
               for d in rows[1]]
    return {TASKS[0]: mc, TASKS[1]: rolling, TASKS[2]: [greedy_text(model, tokenizer, d["context"], length)
                                                        for d in rows[2]]}


def assert_same(got: dict, expected: dict, atol: float = 2e-4) -> None:
    """Equal answers: log-likelihoods to float32 rounding, greedy flags and generated texts exactly."""
    for g, e in zip(got[TASKS[0]], expected[TASKS[0]], strict=True):
        np.testing.assert_allclose([s for s, _ in g], [s for s, _ in e], atol=atol, rtol=1e-6)
        assert [f for _, f in g] == [f for _, f in e]
    np.testing.assert_allclose(got[TASKS[1]], expected[TASKS[1]], atol=atol * 10, rtol=1e-6)
    assert got[TASKS[2]] == expected[TASKS[2]]


@needs_lm_eval
def test_native_model_scores_as_the_full_forward(tasks, native, v32):
    """The native model (ESS) on the three tasks: every choice's log-likelihood and greedy flag, every rolling
    document (several windows each), every greedy generation as the full forward gives them."""
    answers, result = native
    assert [len(answers[t]) for t in TASKS] == [20, 3, 5]
    assert_same(answers, reference(tasks, v32, "tiny-v32-code", MAX_LENGTH))
    windows = [len(rolling_pairs(hf_tokenizer("tiny-v32-code"), json.loads(d)["text"], MAX_LENGTH))
               for d in (tasks / "rolling.jsonl").read_text().splitlines()]
    assert windows[0] == 1 and min(windows[1:]) >= 2, windows  # the documents exercise lm-eval's windowing
    assert any(answers[TASKS[2]]) and result["config"]["model"] == "ESSJaxLM"


@needs_lm_eval
def test_multiple_choice_accuracy_is_above_chance(native):
    """The tripwire for a scorer at chance (1/4): the shipped model picks the real next line of code."""
    _, result = native
    assert result["results"][TASKS[0]]["acc,none"] >= 0.7, result["results"][TASKS[0]]


@needs_lm_eval
@pytest.mark.parametrize("backend", ["huggingface", "remote"])
def test_server_scores_as_the_native_model(served, native, backend):
    """local-completions against ``python -m ess_jax.serve``: the same answers as the native model, task by
    task and document by document (the server's tokens through transformers or through /tokenize)."""
    assert_same(served(backend), native[0])


@needs_lm_eval
def test_rolling_document_scores_as_python_m_ess_jax_eval(tasks, native, tmp_path):
    """A rolling document that fits one window is ``python -m ess_jax.eval``'s text (bos and the document's
    tokens, one window): its log-likelihood is minus eval's mean NLL times the tokens it scored."""
    text = json.loads((tasks / "rolling.jsonl").read_text().splitlines()[0])["text"]
    (tmp_path / "doc.txt").write_text(text)
    tokens = len(hf_tokenizer("tiny-v32-code")(text).input_ids)
    out = subprocess.run([sys.executable, "-m", "ess_jax.eval", "--model", "tiny-v32-code", "--text",
                          str(tmp_path / "doc.txt"), "--context", str(tokens), "--paths", "resident", "--json"],
                         capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    scored = report["paths"]["resident"]
    assert report["windows"] == 1 and scored["tokens"] == tokens - 1
    assert np.isclose(-scored["nll"] * scored["tokens"], native[0][TASKS[1]][0], atol=2e-3)


@needs_lm_eval
def test_native_v4_rolling_scores_as_the_full_forward(tasks):
    """tiny-v4-code (HiSparse) as the native model on the rolling documents of several windows, each window
    prefilled in pieces of 32 tokens, scored as the full forward scores it."""
    from ess_jax.lm_eval import ESSJaxLM

    model, length = ess_jax.load_model("tiny-v4-code"), 127  # windows of 128 tokens: four pieces of 32
    lm = ESSJaxLM(model=model, max_length=length, **SHAPE)
    got = responses(evaluate(tasks, lm, [TASKS[1]], samples={TASKS[1]: [1, 2]}))
    tokenizer = hf_tokenizer("tiny-v4-code")
    docs = [json.loads(line)["text"] for line in (tasks / "rolling.jsonl").read_text().splitlines()[1:]]
    windows = [rolling_pairs(tokenizer, d, length) for d in docs]
    assert {len(c) + len(x) for w in windows for c, x in w} == {length + 1}
    np.testing.assert_allclose(got[TASKS[1]], [sum(s for s, _ in reference_scores(model, w, length + 1))
                                               for w in windows], atol=2e-3, rtol=1e-6)


@needs_lm_eval
@pytest.mark.parametrize("name", ["tiny-v32-code", "tiny-v4-code"])
def test_shipped_checkpoints_load_in_transformers(name):
    """``AutoTokenizer.from_pretrained(<checkpoint>)`` (lm-eval's huggingface backend): the ids of
    ``ess_jax``'s tokenizer, with and without the bos its post-processor adds, and bos / eos / pad as
    config.json numbers them."""
    tokenizer, model_cfg = hf_tokenizer(name), source_config(resolve_model(name))
    ours = load_tokenizer(resolve_model(name).checkpoint, model_cfg)
    text = HELDOUT.read_text()[:6000]
    for special in (True, False):
        assert tokenizer(text, add_special_tokens=special).input_ids == ours.encode(text, add_special_tokens=special)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        model_cfg.bos_token_id, model_cfg.eos_token_id[0], model_cfg.pad_token_id)
    ids = ours.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == ours.decode(ids)


@needs_lm_eval
def test_bad_model_args_are_refused_by_name():
    from ess_jax.lm_eval import ESSJaxLM

    with pytest.raises(ValueError, match="unrecognized arguments: --pretrained"):
        ESSJaxLM(pretrained="tiny-v32-code")
    with pytest.raises(ValueError, match="max_batch is lm-eval's --batch_size"):
        ESSJaxLM(max_batch=4)
    with pytest.raises(ValueError, match="--pool-ratio"):
        ESSJaxLM(pool_ratio=2.0)
    with pytest.raises(ValueError, match="batch_size='auto'"):
        ESSJaxLM(batch_size="auto")


def test_without_lm_eval_the_module_imports_and_says_what_to_install():
    """With lm-eval missing, ``ess_jax.lm_eval`` imports; making the model or running the command line names
    ``pip install 'ess_jax[eval]'``."""
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "import ess_jax.lm_eval as m\n"
            "try:\n    m.ESSJaxLM()\nexcept ImportError as e:\n    print(e)\n"
            "sys.exit(m.main([]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 2, out.stderr
    assert "pip install 'ess_jax[eval]'" in out.stdout and "pip install 'ess_jax[eval]'" in out.stderr
