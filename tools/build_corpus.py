"""Build the Python-code training corpus and its byte-level BPE tokenizer.

    python tools/build_corpus.py --out DIR [--vocab-size 4096] [--python-lib PATH]
                                 [--heldout-text FILE]

File list. Every ``*.py`` file under the Python standard library of the running interpreter
(``sysconfig.get_paths()["stdlib"]``, or ``--python-lib``), except files with a path component
named ``site-packages``, ``test``, ``tests``, ``idlelib``, ``lib2to3``, ``turtledemo`` or
``__pycache__``, files that are not valid UTF-8 and files over 400 KB (``MAX_FILE_BYTES``). The
list is the sorted relative POSIX paths, so the same library always gives the same list.

Split. A file is held out iff the first component of its relative path is in ``HELDOUT`` (about 3%
of the bytes of CPython 3.13's library); every other file trains. No file is in both.

Tokenizer. Byte-level BPE (``tokenizers``: ByteLevel pre-tokenizer with add_prefix_space=False,
ByteLevel decoder, BpeTrainer over the 256-byte initial alphabet) trained on the train files only.
The vocabulary size includes the special tokens ``<bos>`` = 0, ``<eos>`` = 1, ``<pad>`` = 2. The
post-processor prepends ``<bos>`` to a single sequence (``encode(text).ids[0] == 0``). The same
inputs give a byte-identical tokenizer.json. A file whose text contains a special token's text is
an error (it would split its document).

Outputs in DIR:

- ``tokenizer.json``: the tokenizer above.
- ``train.npy``, ``heldout.npy``: uint16 token ids, each file encoded without special tokens and
  the documents joined as ``<bos> doc1 <eos> <bos> doc2 <eos> ...`` in the sorted file order.
- ``manifest.json``: ``python_version`` (sys.version), ``stdlib``, ``vocab_size``, ``heldout``
  (the HELDOUT list), ``files`` (per file: ``path``, ``sha256`` of its bytes, ``split``, ``bytes``,
  ``tokens``, the latter without the ``<bos>``/``<eos>`` around it) and ``totals`` (per split:
  ``files``, ``bytes``, ``tokens`` = the length of its .npy, ``bytes_per_token`` = bytes over the
  document tokens).

``--heldout-text FILE`` also writes the held-out documents, whole files in sorted order until their
total passes ``HELDOUT_TEXT_BYTES`` (48 KB), each preceded by a line ``# file: <relative path>``
(the regression-test fixture ``checkpoints/heldout_code.txt``).

Errors (no library at the path, a vocabulary size outside [300, 65535], an output that cannot be
written, a special token's text in a file) print one line ``error: ...`` and exit with status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EXCLUDED_PARTS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
)
MAX_FILE_BYTES = 400 * 1024
HELDOUT = (
    "csv.py",
    "fractions.py",
    "graphlib.py",
    "heapq.py",
    "json",
    "pprint.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "tomllib",
)
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
BOS, EOS = 0, 1
MIN_VOCAB, MAX_VOCAB = 300, 65535
HELDOUT_TEXT_BYTES = 48 * 1024


class CorpusError(Exception):
    """A problem with the inputs or outputs; the message names it and the fix."""


def collect_files(stdlib: Path) -> list[dict]:
    """The selected files, sorted by relative POSIX path: path, text, raw bytes, split."""
    if not stdlib.is_dir():
        raise CorpusError(f"no standard library at {stdlib}: pass --python-lib with its directory")
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if EXCLUDED_PARTS.intersection(rel.parts) or not path.is_file():
            continue
        data = path.read_bytes()
        if len(data) > MAX_FILE_BYTES:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        split = "heldout" if rel.parts[0] in HELDOUT else "train"
        files.append({"path": rel.as_posix(), "text": text, "data": data, "split": split})
    if not any(f["split"] == "train" for f in files):
        raise CorpusError(
            f"no training .py files under {stdlib}: pass --python-lib with a Python standard library"
        )
    files.sort(key=lambda f: f["path"])
    return files


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE over ``texts`` with <bos>, <eos>, <pad> as ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS)]
    )
    return tokenizer


def join_documents(docs: list[list[int]]) -> np.ndarray:
    """``<bos> doc1 <eos> <bos> doc2 <eos> ...`` as uint16."""
    out = np.empty(sum(len(d) + 2 for d in docs), np.uint16)
    pos = 0
    for doc in docs:
        out[pos] = BOS
        out[pos + 1 : pos + 1 + len(doc)] = doc
        out[pos + 1 + len(doc)] = EOS
        pos += len(doc) + 2
    return out


def heldout_text(files: list[dict]) -> str:
    """Held-out files in order, each after a ``# file:`` line, until the total passes 48 KB."""
    parts, total = [], 0
    for f in files:
        if f["split"] != "heldout":
            continue
        text = f["text"] if f["text"].endswith("\n") else f["text"] + "\n"
        parts.append(f"# file: {f['path']}\n{text}")
        total += len(parts[-1].encode("utf-8"))
        if total > HELDOUT_TEXT_BYTES:
            break
    return "".join(parts)


def build(stdlib: Path, out: Path, vocab_size: int, heldout_text_path: Path | None = None) -> dict:
    """Write tokenizer.json, train.npy, heldout.npy and manifest.json to ``out``; the manifest."""
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise CorpusError(
            f"--vocab-size {vocab_size} is out of range: pass a value in [{MIN_VOCAB}, {MAX_VOCAB}]"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CorpusError(f"cannot write to --out {out} ({e.strerror}): pass a writable directory")
    files = collect_files(stdlib)
    tokenizer = train_tokenizer([f["text"] for f in files if f["split"] == "train"], vocab_size)
    encodings = tokenizer.encode_batch([f["text"] for f in files], add_special_tokens=False)
    for f, enc in zip(files, encodings):
        if set(enc.ids) & set(range(len(SPECIAL_TOKENS))):
            raise CorpusError(
                f"{f['path']} contains a special token's text ({', '.join(SPECIAL_TOKENS)}), "
                "which would split its document: remove it from the library copy"
            )
        f["ids"] = enc.ids
    tokenizer.save(str(out / "tokenizer.json"))

    totals = {}
    for split in ("train", "heldout"):
        chosen = [f for f in files if f["split"] == split]
        tokens = join_documents([f["ids"] for f in chosen])
        np.save(out / f"{split}.npy", tokens)
        n_bytes = sum(len(f["data"]) for f in chosen)
        doc_tokens = sum(len(f["ids"]) for f in chosen)
        totals[split] = {
            "files": len(chosen),
            "bytes": n_bytes,
            "tokens": int(tokens.size),
            "bytes_per_token": round(n_bytes / doc_tokens, 4) if doc_tokens else 0.0,
        }
    manifest = {
        "python_version": sys.version,
        "stdlib": str(stdlib),
        "vocab_size": tokenizer.get_vocab_size(),
        "heldout": list(HELDOUT),
        "files": [
            {
                "path": f["path"],
                "sha256": hashlib.sha256(f["data"]).hexdigest(),
                "split": f["split"],
                "bytes": len(f["data"]),
                "tokens": len(f["ids"]),
            }
            for f in files
        ],
        "totals": totals,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if heldout_text_path is not None:
        try:
            heldout_text_path.write_text(heldout_text(files), encoding="utf-8")
        except OSError as e:
            raise CorpusError(
                f"cannot write --heldout-text {heldout_text_path} ({e.strerror}): "
                "pass a writable file path"
            )
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--vocab-size", type=int, default=4096, help="incl. 3 special tokens")
    parser.add_argument(
        "--python-lib",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="standard library directory (default: the running interpreter's)",
    )
    parser.add_argument("--heldout-text", type=Path, help="also write the held-out text fixture")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        manifest = build(args.python_lib, args.out, args.vocab_size, args.heldout_text)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    for split, t in manifest["totals"].items():
        print(
            f"{split}: {t['files']} files, {t['bytes']} bytes, {t['tokens']} tokens, "
            f"{t['bytes_per_token']} bytes/token"
        )
    print(f"vocab {manifest['vocab_size']}, {elapsed:.1f} s, written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
