"""Tokenizers. A checkpoint directory with a ``tokenizer.json`` gets its own tokenizer (``HFTokenizer``);
presets and checkpoints without one get a byte-level tokenizer (``ByteTokenizer``): ids 0-255 are
UTF-8 bytes, special ids (bos / eos / pad from the config) live above them."""

from __future__ import annotations

from pathlib import Path

import tokenizers

from ess_jax.config import ConfigError, ModelConfig


class ByteTokenizer:
    def __init__(self, cfg: ModelConfig):
        self.vocab_size = cfg.vocab_size
        self.bos_token_id = cfg.bos_token_id

    def encode(self, text: str) -> list[int]:
        if self.vocab_size < 256:
            raise ValueError(f"a byte-level tokenizer needs vocab_size >= 256 (model has {self.vocab_size}); "
                             "pass token ids instead of text")
        bos = [self.bos_token_id] if self.bos_token_id is not None and self.bos_token_id >= 256 else []
        return bos + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's ``tokenizer.json``, through the ``tokenizers`` library.

    ``encode`` applies the file's post-processor and nothing else: DeepSeek's adds the bos token, so
    prompts match ``AutoTokenizer(text)``; a file without one gets no special tokens. ``decode`` drops
    special tokens (bos / eos / the chat markers).
    """

    def __init__(self, path: str | Path, *, vocab_size: int):
        path = Path(path)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on unreadable or malformed files
            raise ConfigError(f"cannot read tokenizer {path}: {e}") from None
        largest = max(self._tokenizer.get_vocab(with_added_tokens=True).values())
        if largest >= vocab_size:
            raise ConfigError(f"{path} has token id {largest}, outside the model's vocab_size={vocab_size}")

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(directory: str | Path | None, cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of a checkpoint directory: its ``tokenizer.json`` if it has one, else byte-level
    (also for ``directory=None``, the presets)."""
    if directory is not None and (Path(directory) / "tokenizer.json").is_file():
        return HFTokenizer(Path(directory) / "tokenizer.json", vocab_size=cfg.vocab_size)
    return ByteTokenizer(cfg)
