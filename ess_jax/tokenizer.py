"""Tokenizers. A checkpoint directory with a ``tokenizer.json`` gets its own tokenizer (``HFTokenizer``);
presets and checkpoints without one get a byte-level tokenizer (``ByteTokenizer``): ids 0-255 are
UTF-8 bytes, special ids (bos / eos / pad from the config) live above them."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from ess_jax.config import ConfigError, ModelConfig


def check_limit(tokens: int, limit: int | None) -> None:
    if limit is not None and tokens > limit:
        raise ValueError(f"the text is {tokens} tokens, more than the {limit} a request may have")


class ByteTokenizer:
    def __init__(self, cfg: ModelConfig):
        self.vocab_size = cfg.vocab_size
        self.bos_token_id = cfg.bos_token_id

    def encode(self, text: str, *, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """The UTF-8 bytes, after the bos id (when it lies above the bytes) with ``add_special_tokens``; ValueError
        when they are more than ``limit`` tokens (checked before the ids are listed)."""
        if self.vocab_size < 256:
            raise ValueError(f"a byte-level tokenizer needs vocab_size >= 256 (model has {self.vocab_size}); "
                             "pass token ids instead of text")
        special = add_special_tokens and self.bos_token_id is not None and self.bos_token_id >= 256
        bos = [self.bos_token_id] if special else []
        data = text.encode("utf-8")
        check_limit(len(bos) + len(data), limit)
        return bos + list(data)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id]) if 0 <= token_id < 256 else f"<{token_id}>"


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
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        if not vocab:
            raise ConfigError(f"{path} has an empty vocabulary: not the tokenizer of this checkpoint")
        largest = max(vocab.values())
        if largest >= vocab_size:
            raise ConfigError(f"{path} has token id {largest}, outside the model's vocab_size={vocab_size}")

    def encode(self, text: str, *, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """``add_special_tokens=False`` skips the post-processor (a rendered chat template has its bos); ValueError
        when the text is more than ``limit`` tokens (checked before the ids are listed). Through ``encode_batch_fast``,
        which lets other Python threads run meanwhile (``encode`` holds the interpreter for the whole text) and keeps
        no character offsets (freeing a 2M-token encoding with them holds the interpreter for ~150 ms)."""
        encoding = self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        check_limit(len(encoding), limit)
        return encoding.ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), for per-token log-probabilities."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


class ChatTemplate:
    """A checkpoint's chat template (``tokenizer_config.json``'s ``chat_template``), rendered with jinja2
    as transformers renders it: a sandboxed environment with ``trim_blocks`` / ``lstrip_blocks``, the
    loop-controls extension, ``raise_exception`` and a ``tojson`` filter; the special tokens of the
    config (``bos_token``, ``eos_token``, ...) are template variables."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                    ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ConfigError(f"the chat template does not parse: {e}") from None
        self.source, self.special_tokens = source, special_tokens

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from None


def load_chat_template(directory: str | Path | None) -> ChatTemplate | None:
    """The chat template of a checkpoint directory's ``tokenizer_config.json``, or None without one."""
    path = None if directory is None else Path(directory) / "tokenizer_config.json"
    if path is None or not path.exists():
        return None
    if not path.is_file():
        raise ConfigError(f"{path} is not a file: remove it or put the checkpoint's tokenizer_config.json there")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is a JSON {type(config).__name__}, not an object")
    source = config.get("chat_template")
    if source is not None and not isinstance(source, (str, list)):
        raise ConfigError(f"{path}: chat_template must be a string or a list of named templates")
    if isinstance(source, list) and not all(isinstance(t, dict) for t in source):
        raise ConfigError(f"{path}: chat_template as a list must hold {{'name', 'template'}} objects")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    special = {}
    for key, value in config.items():
        if key.endswith("_token") and value is not None:
            special[key] = value.get("content", "") if isinstance(value, dict) else str(value)
    return ChatTemplate(source, special)


def read_chat_template(path: str | Path, tokenizer: Tokenizer, cfg: ModelConfig,
                       checkpoint: ChatTemplate | None) -> ChatTemplate:
    """A chat template from a jinja2 file (``serve --chat-template``, as vLLM's flag), for checkpoints without one
    or to replace theirs; its special-token variables are the checkpoint's ``tokenizer_config.json`` ones when
    it has a template, else ``bos_token`` / ``eos_token`` as the tokenizer writes the config's ids."""
    path = Path(path)
    try:
        source = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template {path}: cannot read it ({e}); give a jinja2 template file") from None
    if not source.strip():
        raise ConfigError(f"--chat-template {path} is empty; give a jinja2 template file")
    if checkpoint is not None:
        special = checkpoint.special_tokens
    else:
        ids = {"bos_token": cfg.bos_token_id, "eos_token": cfg.eos_token_id[0] if cfg.eos_token_id else None}
        special = {name: tokenizer.token_text(i) for name, i in ids.items() if i is not None}
    try:
        return ChatTemplate(source, special)
    except ConfigError as e:
        raise ConfigError(f"--chat-template {path}: {e}") from None


def load_tokenizer(directory: str | Path | None, cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of a checkpoint directory: its ``tokenizer.json`` if it has one, else byte-level
    (also for ``directory=None``, the presets); a ``tokenizer.json`` that is not a file is an error."""
    path = None if directory is None else Path(directory) / "tokenizer.json"
    if path is not None and path.exists():
        if not path.is_file():
            raise ConfigError(f"{path} is not a file: remove it (for the byte-level tokenizer) or put the "
                              "checkpoint's tokenizer.json there")
        return HFTokenizer(path, vocab_size=cfg.vocab_size)
    return ByteTokenizer(cfg)


class IncrementalDetokenizer:
    """The text of a growing token sequence, handed out in deltas, in time linear in the sequence.

    Each ``push`` decodes only a window (vLLM's prefix and read offsets): the ids from the start of the last delta's
    tokens (``prefix``, their text the context for decoders that read a token's neighbour, such as a leading space)
    to the end; the delta is that text past the context's. While the window's text ends in replacement characters
    (U+FFFD: the bytes of an unfinished UTF-8 character, or the first bytes of a multi-byte piece split across tokens)
    nothing is handed out, until the tokens that complete them come. With ``final=True`` nothing is held back, so the
    deltas concatenate to ``decode(all ids)`` exactly (for decoders whose text of a prefix is a prefix of the text:
    byte-level ones, both tokenizers here).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window's start: the last delta's first token
        self.read = 0  # ids handed out: the window's context ends here
        self.context = ""  # the text of ids[prefix:read]

    def push(self, ids: list[int], *, final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if (not final and text.endswith("\ufffd")) or len(text) < len(self.context):
            return ""
        delta = text[len(self.context):]
        self.prefix, self.read = self.read, len(self.ids)
        self.context = self.tokenizer.decode(self.ids[self.prefix:self.read])
        return delta
