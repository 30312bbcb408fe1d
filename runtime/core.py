"""Request and batch state shared by the scheduler, engine and server. Imports no other runtime module.

Lengths (one meaning each): `seq_len` = prompt + generated tokens; `cached_len` = leading tokens whose
KV rows sit in the pool; `extend_len` = seq_len - cached_len (tokens whose KV is still to compute).
A request is sampled in a step when that step brings cached_len up to seq_len.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any


class ReqStatus(str, enum.Enum):
    WAITING = "waiting"  # queued, no pages (new, or retracted with recompute)
    PREFILLING = "prefilling"  # part of the prompt computed (chunked prefill), holds pages
    RUNNING = "running"  # decoding, holds pages
    RETRACTED = "retracted"  # pages given back; KV backed up on CPU (or dropped for recompute)
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: pages pre-allocated, KV written by a peer
    HANDED_OFF = "handed_off"  # prefill role: KV and first token given to the transfer hook
    FINISHED = "finished"
    ABORTED = "aborted"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client disconnect or an explicit abort
    ERROR = "error"


class RequestError(ValueError):
    """A request that can never run (a 400 for its client); `param`: the request field at fault, if one is."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


MIN_TEMPERATURE = 1e-5  # a smaller temperature > 0 samples greedily, as 0 does


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature 0 (or below MIN_TEMPERATURE) = greedy; top_k -1 = off; top_p 1 = off;
    min_p 0 = off; seed None = a random one drawn at arrival (sampling stays reproducible per seed,
    whatever the batch); logprobs None = none, n >= 0 = the chosen token's logprob plus the top n."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # logits / T overflow fp32 for a tiny T (+-inf, whose argmax is the first positive logit, not the largest);
        # sampling at it is greedy in all but ties, so it is greedy (vLLM draws the same line)
        if isinstance(self.temperature, (int, float)) and 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0

    def validate(self) -> None:
        """Raise RequestError (a ValueError) naming the bad field and the allowed range."""
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise RequestError(f"temperature must be in [0, 100], got {self.temperature}", "temperature")
        if self.top_k != -1 and not (1 <= self.top_k < 2**62):
            raise RequestError(f"top_k must be -1 (off) or in [1, 2**62), got {self.top_k}", "top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not (0.0 <= self.min_p <= 1.0):
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if any(not (-2**63 <= t < 2**63) for t in self.stop_token_ids):
            raise RequestError("stop_token_ids must be 64-bit integers", "stop_token_ids")
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise RequestError(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise RequestError(f"seed must be in [0, 2**63), got {self.seed}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_rid_counter = itertools.count()


@dataclass(eq=False)
class Req:
    """One generation request. Owned by the scheduler; the engine only reads it.

    prompt_ids / output_ids: host lists of token ids. pages: page ids in the KV pool, in order
    (page i holds positions [i*page_size, (i+1)*page_size)). backup: CPU copy of the KV while
    retracted (None = recompute on resume). table_row: this request's row in the device page table.
    """

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = ""
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    cached_len: int = 0
    pages: list[int] = field(default_factory=list)
    # the prefix cache's node of its last shared page (--enable-prefix-caching): its first `prefix_pages` pages are
    # the cache's, read-only
    prefix_node: Any = None
    cached_tokens: int | None = None  # prompt tokens its admission took from a prefix cache (None: no cache)
    table_row: int = -1
    table_len: int = 0  # how many of `pages` are written into the device page-table row
    backup: Any = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    seed: int = 0
    order: int = field(default_factory=lambda: next(_rid_counter))  # arrival order, for policies
    admitted_at: int = -1  # admission counter (retraction victim order)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_retractions: int = 0
    output_logprobs: list[Any] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # role hooks (e.g. transfer ids) keep theirs here

    def __post_init__(self) -> None:
        if not self.rid:
            self.rid = f"req-{self.order}"

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def extend_len(self) -> int:
        return self.seq_len - self.cached_len

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefix_pages(self) -> int:
        """How many of its first pages it reads from the prefix cache (0 without one)."""
        return self.prefix_node.depth if self.prefix_node is not None else 0

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end] if end > len(self.prompt_ids) \
            else self.prompt_ids[start:end]

    @property
    def finished(self) -> bool:
        return self.status in (ReqStatus.FINISHED, ReqStatus.ABORTED)


@dataclass
class Batch:
    """One forward step. Filled by the scheduler: reqs, extend_lens (new tokens per request, each
    starting at req.cached_len), is_decode. The engine reads it and builds the device tensors."""

    reqs: list[Req]
    extend_lens: list[int]
    is_decode: bool

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def samples(self, i: int) -> bool:
        """True when request i reaches its full length in this step (its logits are sampled)."""
        r = self.reqs[i]
        return r.cached_len + self.extend_lens[i] == r.seq_len


@dataclass
class StepOutput:
    """What one request got from one step: new token ids (0 or 1 here), new text, and on finish the
    reason. Sent from the engine loop to whoever waits on the request (HTTP handler, offline API)."""

    rid: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[Any] = field(default_factory=list)  # per new token: (logprob, [(id, logprob), ...])
    error: str | None = None
    # the HTTP status of a failure (`error`): 400 the request's fault, 500 an internal error, 502 a peer server
    # (the prefill of a disaggregated pair) failed, 503 no capacity within the timeout
    error_status: int = 400
    cached_tokens: int | None = None  # on finish: prompt tokens read from the prefix cache (None: no cache)


# token ids below 0 in a step's host results: that request's logits could not be sampled (engine → scheduler)
NAN_LOGITS, NO_FINITE_LOGIT, INF_LOGITS = -1, -2, -3
_BAD_LOGITS = {NAN_LOGITS: "NaN logits", INF_LOGITS: "+inf logits", NO_FINITE_LOGIT: "logits that are all -inf"}


def bad_logits_error(code: int, token_index: int) -> str:
    """The error of a request whose logits (a `check_logits` code) could not be sampled at output token
    `token_index` (1-based): the model's or its kernels' numerical fault, not the request's."""
    what = _BAD_LOGITS.get(code, f"unsampleable logits (code {code})")
    return (f"the model produced {what} for this request at output token {token_index}; nothing can be sampled "
            "from them (a numerical fault of the model or its kernels, not of the request); the request is ended")


def filler_ids(n: int, vocab: int, stride: int = 7, salt: int = 0) -> list[int]:
    """n token ids in [2, vocab) (ids 0 and 1 are usually special) that vary along the prompt: prompts for
    warm-up and measurements, whose values do not matter. Different `salt`s give different prompts."""
    return [(stride * j + salt) % (vocab - 2) + 2 for j in range(n)]
