"""Host-side post-processing of sampled tokens: incremental detokenization and stop checks
(EOS, stop token ids, stop strings, max_tokens, context limit)."""

from __future__ import annotations

from typing import Callable

from pdlab.runtime.core import FinishReason, Req


class TextCodec:
    """Adapter over a tokenizer: `tokenizers.Tokenizer`, a transformers tokenizer, or any object with
    encode(text) -> ids | Encoding and decode(ids) -> str. eos_token_ids: ids that end generation."""

    def __init__(self, tokenizer, eos_token_ids: list[int] | None = None):
        self.tok = tokenizer
        ids = list(eos_token_ids or [])
        for v in [getattr(tokenizer, "eos_token_id", None), *(getattr(tokenizer, "eos_token_ids", None) or ())]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)
        self.eos_token_ids = ids
        self._bytes_of: Callable[[int], bytes | None] | None = None  # token_bytes' reader, built on first use
        self._max_piece: int | None = -1  # the vocabulary's longest piece in characters (-1: not read yet)

    def encode(self, text: str) -> list[int]:
        enc = self.tok.encode(text)  # the tokenizer's own default (e.g. a BOS token) for prompts
        return list(getattr(enc, "ids", enc))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        try:
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        except TypeError:
            return self.tok.decode(ids)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat: the tokenizer's chat template when it has one, else a plain
        "role: content" transcript ending with "assistant:" ("role (name): content" for a message with a `name`, which
        a template gets too)."""
        try:
            if hasattr(self.tok, "encode_chat"):  # pdlab's tokenizer
                return list(self.tok.encode_chat(messages, add_generation_prompt=True))
            if hasattr(self.tok, "apply_chat_template"):  # a transformers tokenizer
                out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                return list(out["input_ids"] if isinstance(out, dict) else out)
        except ValueError as exc:
            if not _no_template(exc):
                raise  # the template rejected these messages: the caller's error
        text = "".join(f"{_speaker(m)}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def max_text_chars(self, tokens: int) -> int | None:
        """The most characters a text that tokenizes to at most `tokens` tokens can have (None when the tokenizer
        shows no vocabulary): a longer text is over `tokens` without tokenizing it. A token covers at most its
        vocabulary piece's length in characters (byte-level pieces: one per byte); the factor 4 leaves room for a
        normalizer that composes characters (NFC makes one Hangul syllable of three jamo)."""
        if self._max_piece == -1:
            backend = getattr(self.tok, "_tok", None) or getattr(self.tok, "backend_tokenizer", None) or self.tok
            try:
                self._max_piece = max(map(len, backend.get_vocab()), default=0) or None
            except Exception:  # no get_vocab, or one that fails: no bound
                self._max_piece = None
        return None if self._max_piece is None else tokens * self._max_piece * 4

    def token_bytes(self, token_id: int) -> bytes | None:
        """A token's own bytes, for a byte-level BPE tokenizer (DeepSeek's: a single byte of a multi-byte character
        is a token there, whose text alone is no character); None where they cannot be known (other tokenizers,
        added tokens, ids without a piece)."""
        if self._bytes_of is None:
            self._bytes_of = _byte_level_reader(self.tok)
        return self._bytes_of(token_id)


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the character that stands for each byte in a token's piece. Printable
    Latin-1 bytes stand for themselves; the others, in byte order, for characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(rest)}}


def _byte_level_reader(tok) -> Callable[[int], bytes | None]:
    """token id -> its bytes where `tok` (pdlab's Tokenizer, a tokenizers.Tokenizer or a transformers fast tokenizer)
    decodes byte-level; else a reader that always answers None."""
    backend = getattr(tok, "_tok", None) or getattr(tok, "backend_tokenizer", None) or tok
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel" or not hasattr(backend, "id_to_token"):
        return lambda t: None
    table = _byte_level_table()
    added = getattr(backend, "get_added_tokens_decoder", lambda: {})()  # their pieces are plain text

    def token_bytes(t: int) -> bytes | None:
        piece = backend.id_to_token(t)
        if piece is None or t in added or not all(ch in table for ch in piece):
            return None
        return bytes(table[ch] for ch in piece)

    return token_bytes


class OutputState:
    """Per-request detokenization state (kept in req.meta["out"])."""

    __slots__ = ("prefix_offset", "read_offset", "text", "sent")

    def __init__(self):
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.sent = 0


def process_token(req: Req, token: int, codec: TextCodec | None, max_context_len: int) -> tuple[str, FinishReason | None]:
    """Append `token` to req (already done by the caller) and return (new text to emit, finish reason)."""
    p = req.params
    st: OutputState = req.meta.setdefault("out", OutputState())
    eos = codec.eos_token_ids if codec is not None else []
    finish = None
    hide = token in p.stop_token_ids or (not p.ignore_eos and token in eos)  # its text is never emitted
    if hide:
        finish = FinishReason.STOP
    elif len(req.output_ids) >= p.max_tokens or req.seq_len >= max_context_len:
        finish = FinishReason.LENGTH  # unless a stop string ends it first
    if codec is not None:
        ids, end = req.output_ids, len(req.output_ids) - hide
        prefix = codec.decode(ids[st.prefix_offset:st.read_offset], p.skip_special_tokens)
        full = codec.decode(ids[st.prefix_offset:end], p.skip_special_tokens)
        # a trailing U+FFFD may be a character whose other bytes come with the next tokens: wait for them, unless
        # the request ends here (then it is U+FFFD, as decoding the output gives it)
        if len(full) > len(prefix) and (finish is not None or not full.endswith("\ufffd")):
            st.text += full[len(prefix):]
            st.prefix_offset = st.read_offset
            st.read_offset = end
    if p.stop and st.text:
        longest = max(len(s) for s in p.stop)
        start = max(0, st.sent - longest + 1)
        hits = [i for i in (st.text.find(s, start) for s in p.stop) if i >= 0]
        if hits:
            st.text = st.text[:min(hits)]
            finish = FinishReason.STOP
    if finish is None and p.stop:
        safe = max(st.sent, len(st.text) - (max(len(s) for s in p.stop) - 1))  # hold back a possible stop prefix
    else:
        safe = len(st.text)
    new = st.text[st.sent:safe]
    st.sent = max(st.sent, safe)
    return new, finish


def _speaker(message: dict) -> str:
    """Who speaks a chat message in the plain transcript: its role, and its `name` when it has one."""
    name = message.get("name")
    return f"{message['role']} ({name})" if name else message["role"]


def _no_template(exc: ValueError) -> bool:
    """The tokenizer has no chat template (pdlab's and transformers' wording), as opposed to a template
    that rejected the messages."""
    text = str(exc)
    return "no chat_template" in text or "chat_template is not set" in text
