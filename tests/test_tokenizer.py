"""Tokenizers: the byte-level fallback, a real ``tokenizer.json`` through ``tokenizers``, and the choice
between them."""

import dataclasses

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from ess_jax.config import ConfigError, ModelConfig, preset_dict
from ess_jax.families import load_config
from ess_jax.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, load_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"  # DeepSeek's special tokens
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, héllo wörld", "你好，世界", "byte-level BPE"]
# Any Unicode text UTF-8 can encode, minus the characters of the special tokens (they would be parsed as such).
TEXT = st.text(st.characters(codec="utf-8", exclude_characters="<｜"), max_size=40)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return load_config(preset_dict("tiny-v32"))  # vocab_size 320, bos 256


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A directory with a byte-level BPE ``tokenizer.json`` (DeepSeek's layout, 300 ids) whose
    post-processor prepends bos."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    directory = tmp_path_factory.mktemp("checkpoint")
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def hf(checkpoint_dir, cfg) -> HFTokenizer:
    return HFTokenizer(checkpoint_dir / "tokenizer.json", vocab_size=cfg.vocab_size)


# ---- ByteTokenizer -----------------------------------------------------------------------------


def test_byte_tokenizer_prepends_bos_and_round_trips_multibyte_text(cfg):
    tok = ByteTokenizer(cfg)
    ids = tok.encode("héllo 你好 🙂")
    assert ids[0] == cfg.bos_token_id == 256
    assert ids[1:] == list("héllo 你好 🙂".encode())
    assert tok.decode(ids + list(cfg.eos_token_id)) == "héllo 你好 🙂"  # special ids are dropped


@settings(max_examples=50, deadline=None)
@given(text=TEXT)
def test_byte_tokenizer_round_trips_any_text(cfg, text):
    tok = ByteTokenizer(cfg)
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_without_room_for_bytes(cfg):
    small = ByteTokenizer(dataclasses.replace(cfg, vocab_size=200, bos_token_id=0))
    with pytest.raises(ValueError, match="needs vocab_size >= 256 .model has 200.; pass token ids"):
        small.encode("hi")
    assert ByteTokenizer(dataclasses.replace(cfg, bos_token_id=0)).encode("hi") == [104, 105]  # no bos among bytes


# ---- HFTokenizer -------------------------------------------------------------------------------


def test_hf_tokenizer_adds_only_the_post_processor_bos(hf):
    ids = hf.encode("hello world")
    assert ids[0] == 0  # BOS, the first special token
    assert 0 not in ids[1:] and 1 not in ids
    assert len(ids) < len("hello world")  # merges learnt from the corpus apply
    assert hf.decode(ids + [1]) == "hello world"  # bos and eos are skipped


@settings(max_examples=50, deadline=None)
@given(text=TEXT)
def test_hf_tokenizer_round_trips_any_text(hf, text):
    assert hf.decode(hf.encode(text)) == text


def test_hf_tokenizer_errors(checkpoint_dir, tmp_path):
    with pytest.raises(ConfigError, match="has token id 299, outside the model's vocab_size=299"):
        HFTokenizer(checkpoint_dir / "tokenizer.json", vocab_size=299)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read tokenizer .*tokenizer.json"):
        HFTokenizer(tmp_path / "tokenizer.json", vocab_size=320)


# ---- load_tokenizer ----------------------------------------------------------------------------


def test_load_tokenizer_picks_tokenizer_json_when_present(checkpoint_dir, cfg, tmp_path):
    assert isinstance(load_tokenizer(checkpoint_dir, cfg), HFTokenizer)
    assert isinstance(load_tokenizer(str(checkpoint_dir), cfg), HFTokenizer)
    assert isinstance(load_tokenizer(tmp_path, cfg), ByteTokenizer)  # a checkpoint without tokenizer.json
    assert isinstance(load_tokenizer(None, cfg), ByteTokenizer)  # a preset


def test_incremental_detokenization_is_linear_in_the_reply(cfg):
    """A 16K-token reply pushed one token at a time decodes each token a bounded number of times (vLLM's offsets):
    the decoder reads O(n) ids in all, not O(n^2), and the deltas concatenate to the whole text."""
    class Counting(ByteTokenizer):
        read = 0

        def decode(self, ids):
            Counting.read += len(ids)
            return super().decode(ids)

    tokenizer = Counting(cfg)
    ids = list(("héllo wörld 🙂 " * 1200).encode())[:16384]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push([t], final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert text == ByteTokenizer(cfg).decode(ids)
    assert Counting.read < 8 * len(ids)
