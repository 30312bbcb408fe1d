"""`Tokenizer`: a HF `tokenizer.json` (via the `tokenizers` library) plus the few fields of
`tokenizer_config.json` serving needs: BOS handling, EOS ids and the jinja chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence


class Tokenizer:
    """Text ↔ token ids for one model.

    encode(text) → list[int] (BOS prepended when `add_bos_token`); decode(ids) → str;
    apply_chat_template(messages) → prompt text; encode_chat(messages) → ids.
    eos_token_ids: ids that end a generation (tokenizer's EOS plus the model config's)."""

    def __init__(self, tokenizer_json: Any, config: Mapping[str, Any] | None = None,
                 extra_eos_ids: Sequence[int] = ()):
        from tokenizers import Tokenizer as _HFTokenizer

        config = dict(config or {})
        # the JSON text, or a tokenizers.Tokenizer already built from it (from_dir)
        self._tok = _HFTokenizer.from_str(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
        self.config = config
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates (HF's list form): the one named "default"
            template = next((t.get("template") for t in template if isinstance(t, Mapping)
                             and t.get("name") == "default"), template)
        self.chat_template: str | None = template
        if self.chat_template is not None:
            _check_template(self.chat_template)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id = eos
        self.eos_token_ids = tuple(dict.fromkeys([i for i in [eos, *extra_eos_ids] if i is not None]))
        self.pad_token_id = self._tok.token_to_id(self.pad_token) if self.pad_token else None
        self.add_bos_token = bool(config.get("add_bos_token", self.bos_token_id is not None))

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: Sequence[int] = ()) -> "Tokenizer":
        """Load `tokenizer.json` (required) and `tokenizer_config.json` (optional) from a model directory."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in {path}: pdlab reads the fast-tokenizer file "
                                    "(tokenizer.json); copy it from the model's repository")
        cfg_file = path / "tokenizer_config.json"
        from pdlab.runtime.model.config import read_json_object

        config = read_json_object(cfg_file) if cfg_file.is_file() else {}
        from tokenizers import Tokenizer as _HFTokenizer

        try:
            tok = _HFTokenizer.from_str(tj.read_text())
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{tj} cannot be read as a fast tokenizer ({exc}): the file is truncated, corrupt, or "
                             "of a newer tokenizers format; download it again or upgrade `tokenizers`") from None
        try:
            return cls(tok, config, extra_eos_ids)
        except ValueError as exc:
            raise ValueError(f"{cfg_file}: {exc}") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_id(self) -> int:
        """The largest id `encode` can produce (added and special tokens included); -1 for an empty vocabulary."""
        return max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and (
                not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render OpenAI-style messages ([{"role": ..., "content": ...}]) with the model's template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json): use the completions "
                             "API with a plain prompt")
        return _compile(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Chat prompt ids: the rendered template already carries BOS, so no special tokens are added."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, Mapping):  # AddedToken written as a dict
        return tok.get("content")
    return tok


_TEMPLATES: dict[str, Any] = {}


def _check_template(source: Any) -> None:
    """ValueError naming `chat_template` when the template is not a string or does not compile (a server would
    otherwise answer every chat request with a 400 that blames the client)."""
    if not isinstance(source, str):
        raise ValueError(f"chat_template must be a jinja string (or a list of named ones, one named 'default'), "
                         f"got {type(source).__name__}; keep the default template as a string")
    from jinja2 import TemplateSyntaxError

    try:
        _compile(source)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not compile (line {exc.lineno}: {exc.message}); fix the template "
                         "or remove it (chat requests then get a plain 'role: content' transcript)") from None


def _compile(source: str):
    if source not in _TEMPLATES:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
