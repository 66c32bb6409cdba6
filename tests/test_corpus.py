"""tools/build_corpus.py on a small fake standard library: the file-list rule, the split, the
round trip of the token streams, the manifest totals, the determinism and the errors."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

_SPEC = importlib.util.spec_from_file_location(
    "build_corpus", Path(__file__).resolve().parents[1] / "tools" / "build_corpus.py"
)
build_corpus = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(build_corpus)

CODE = '''import os


def greet(name: str) -> str:
    """Say hello to ``name``."""
    return f"hello, {name}! é ü 你好"


class Counter:
    def __init__(self):
        self.count = 0

    def step(self, n=1):
        self.count += n
        return self.count
'''
TRAIN = ["abc.py", "pkg/__init__.py", "pkg/sub/mod.py", "zeta.py"]
HELDOUT = ["fractions.py", "json/__init__.py"]


@pytest.fixture(scope="module")
def stdlib(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lib")
    texts = {p: f"# {p}\n" + CODE * (i + 1) for i, p in enumerate(TRAIN + HELDOUT)}
    texts["pkg/sub/mod.py"] += "x = 1\r\ny = 2"  # CRLF and no final newline survive as they are
    excluded = {
        "test/test_abc.py": CODE,
        "pkg/tests/test_mod.py": CODE,
        "idlelib/run.py": CODE,
        "site-packages/third.py": CODE,
        "__pycache__/abc.py": CODE,
        "huge.py": "x = 1\n" * (build_corpus.MAX_FILE_BYTES // 6 + 1),
        "notes.txt": CODE,
    }
    for rel, text in {**texts, **excluded}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(text.encode("utf-8"))
    (root / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1") + CODE.encode())
    return root


def _build(stdlib: Path, out: Path, extra=()) -> dict:
    args = ["--out", str(out), "--python-lib", str(stdlib), "--vocab-size", "300", *extra]
    assert build_corpus.main(args) == 0
    return json.loads((out / "manifest.json").read_text())


def _documents(tokens: np.ndarray) -> list[list[int]]:
    starts, ends = np.flatnonzero(tokens == 0), np.flatnonzero(tokens == 1)
    assert len(starts) == len(ends) and np.all(starts < ends) and np.all(starts[1:] == ends[:-1] + 1)
    return [tokens[s + 1 : e].tolist() for s, e in zip(starts, ends)]


def test_build(stdlib, tmp_path, capsys):
    manifest = _build(stdlib, tmp_path / "a", extra=["--heldout-text", str(tmp_path / "heldout.txt")])
    out = capsys.readouterr().out
    assert out.startswith("train: 4 files") and "\nheldout: 2 files" in out
    by_split = {s: [f["path"] for f in manifest["files"] if f["split"] == s] for s in ("train", "heldout")}
    assert by_split == {"train": TRAIN, "heldout": HELDOUT}
    assert manifest["vocab_size"] == 300

    tok = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert [tok.id_to_token(i) for i in range(3)] == ["<bos>", "<eos>", "<pad>"]
    assert tok.encode("def f(): pass").ids[0] == 0
    for split, paths in by_split.items():
        tokens = np.load(tmp_path / "a" / f"{split}.npy")
        assert tokens.dtype == np.uint16 and tokens.max() < 300
        docs = _documents(tokens)
        texts = [(stdlib / p).read_bytes().decode("utf-8") for p in paths]
        assert [tok.decode(d) for d in docs] == texts
        files = [f for f in manifest["files"] if f["split"] == split]
        assert [f["tokens"] for f in files] == [len(d) for d in docs]
        assert [f["bytes"] for f in files] == [len(t.encode()) for t in texts]
        totals = manifest["totals"][split]
        assert totals["files"] == len(paths) and totals["tokens"] == tokens.size
        assert totals["bytes"] == sum(f["bytes"] for f in files)

    # Both held-out files are far under 48 KB: the fixture holds them whole.
    expected = "".join(f"# file: {p}\n" + (stdlib / p).read_text() for p in HELDOUT)
    assert (tmp_path / "heldout.txt").read_text() == expected

    _build(stdlib, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert (tmp_path / "a" / "train.npy").read_bytes() == (tmp_path / "b" / "train.npy").read_bytes()


def test_heldout_text_stops_after_48k():
    files = [{"path": f"m{i}.py", "text": "x" * 20000, "split": "heldout"} for i in range(5)]
    text = build_corpus.heldout_text([{"path": "t.py", "text": "t", "split": "train"}, *files])
    assert text.count("# file: ") == 3 and text.startswith("# file: m0.py\n")


@pytest.mark.parametrize(
    "args, words",
    [
        (["--vocab-size", "299"], "--vocab-size 299"),
        (["--vocab-size", "65536"], "--vocab-size 65536"),
        (["--python-lib", "/nonexistent/lib"], "no standard library"),
    ],
)
def test_errors(stdlib, tmp_path, capsys, args, words):
    base = ["--out", str(tmp_path / "o"), "--python-lib", str(stdlib), "--vocab-size", "300"]
    assert build_corpus.main(base + args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and err.count("\n") == 1


def test_unwritable_out(stdlib, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert build_corpus.main(["--out", str(tmp_path / "file" / "o"), "--python-lib", str(stdlib)]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write to --out")
