"""Tokenizers. The presets use a byte-level tokenizer: ids 0-255 are UTF-8 bytes, special ids
(bos / eos / pad from the config) live above them."""

from __future__ import annotations

from ess_jax.config import ModelConfig


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
