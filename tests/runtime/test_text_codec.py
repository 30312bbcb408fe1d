"""TextCodec.chat_prompt over a transformers-style tokenizer: template, no template, rejected messages."""

import pytest

from pdlab.runtime.scheduler.output import TextCodec

MSGS = [{"role": "user", "content": "hi"}]


class HFLike:
    """encode/decode plus transformers' apply_chat_template(tokenize=True) behaviour."""

    def __init__(self, template: str | None):
        self.chat_template = template

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        if messages[0]["role"] != "system":
            raise ValueError("this template needs a system message first")
        return {"input_ids": [7, 8, 9]}


def test_template_ids_are_used():
    assert TextCodec(HFLike("t")).chat_prompt([{"role": "system", "content": "s"}, *MSGS]) == [7, 8, 9]


def test_no_template_falls_back_to_a_transcript():
    assert TextCodec(HFLike(None)).chat_prompt(MSGS) == [ord(c) for c in "user: hi\nassistant:"]


def test_a_template_that_rejects_the_messages_is_the_callers_error():
    with pytest.raises(ValueError, match="needs a system message"):
        TextCodec(HFLike("t")).chat_prompt(MSGS)


def test_the_transcript_names_each_speaker_as_a_template_would():
    """A message's `name` reaches a chat template; the transcript without one kept only the role, so two named users
    read as one speaker."""
    msgs = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "user", "content": "yo", "name": "bob"},
            {"role": "assistant", "content": "hello"}]
    text = "user (ann): hi\nuser (bob): yo\nassistant: hello\nassistant:"
    assert TextCodec(HFLike(None)).chat_prompt(msgs) == [ord(c) for c in text]


@pytest.mark.parametrize("finish", ["length", "stop_token", "eos"])
def test_the_bytes_of_a_character_cut_off_by_the_finish_are_not_dropped(finish):
    """A request that ends (max_tokens, a stop token id, EOS) after a token holding the first byte of a multi-byte
    character: its text is that of its tokens (the byte reads U+FFFD, as decode gives it), not one character short."""
    from pdlab.runtime.core import FinishReason, Req, SamplingParams
    from pdlab.runtime.engine.loop import make_codec
    from pdlab.runtime.model.tiny import TINY_CONFIG, tiny_tokenizer
    from pdlab.runtime.scheduler.output import process_token
    codec = make_codec(tiny_tokenizer(), TINY_CONFIG)
    first_byte = next(t for t in range(512) if codec.token_bytes(t) == "é".encode()[:1])
    a = codec.encode("a")[-1]
    stop = codec.encode("z")[-1]
    ids = [a, first_byte] + ([stop] if finish == "stop_token" else [codec.eos_token_ids[0]] if finish == "eos" else [])
    req = Req([a], SamplingParams(max_tokens=len(ids), stop_token_ids=[stop]))
    text, reason = "", None
    for t in ids:
        req.output_ids.append(t)
        new, reason = process_token(req, t, codec, 4096)
        text += new
    assert reason == (FinishReason.LENGTH if finish == "length" else FinishReason.STOP)
    assert text == codec.decode([a, first_byte]) == "a\ufffd"
