"""Prometheus text metrics of one server: queue and running requests, KV usage, retractions,
TTFT / TPOT / ITL / E2E histograms, prefill and decode step times, tokens served. Observed from the engine loop
thread (the scheduler calls on_token / on_finish / on_retract / on_step), rendered from the HTTP thread."""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS = (0.00025, 0.0005) + LATENCY_BUCKETS  # a decode step of a small model takes well under 1 ms


class Histogram:
    def __init__(self, name: str, help_: str, buckets=LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help_, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {self.count}"]
        return out


class RuntimeMetrics:
    def __init__(self, prefix: str = "pdlab"):
        p = prefix
        self.prefix = p
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "arrival to first generated token")
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "gap between consecutive tokens of a request")
        self.tpot = Histogram(f"{p}_time_per_output_token_seconds", "(last - first token time) / (tokens - 1), per request")
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "arrival to finish, per request")
        self.prefill_step = Histogram(f"{p}_prefill_step_seconds", "one prefill step: schedule, forward, process",
                                      STEP_BUCKETS)
        self.decode_step = Histogram(f"{p}_decode_step_seconds", "one decode step: schedule, forward (or the wait "
                                     "for an overlapped step), process", STEP_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.retractions = 0
        self.finished: dict[str, int] = {}
        self._lock = threading.Lock()

    def on_token(self, req, now: float) -> None:
        with self._lock:
            self.generation_tokens += 1
            if req.first_token_time is None:
                self.ttft.observe(now - req.arrival_time)
                self.prompt_tokens += req.prompt_len
            elif req.last_token_time is not None:
                self.itl.observe(now - req.last_token_time)

    def on_finish(self, req) -> None:
        import time
        with self._lock:
            reason = req.finish_reason.value if req.finish_reason else "unknown"
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.e2e.observe(time.perf_counter() - req.arrival_time)
            n = len(req.output_ids)
            if n > 1 and req.first_token_time is not None and req.last_token_time is not None:
                self.tpot.observe((req.last_token_time - req.first_token_time) / (n - 1))

    def on_step(self, decode: bool, seconds: float) -> None:
        with self._lock:
            (self.decode_step if decode else self.prefill_step).observe(seconds)

    def on_retract(self) -> None:
        with self._lock:
            self.retractions += 1

    def render(self, stats: dict) -> str:
        """Prometheus text exposition; `stats` = Scheduler.stats() (queue, running, KV usage...)."""
        p = self.prefix
        gauges = [("num_requests_waiting", "requests queued, not yet admitted (incl. retracted)", stats.get("num_waiting", 0)),
                  ("num_requests_running", "requests decoding", stats.get("num_running", 0)),
                  ("num_requests_prefilling", "requests part-way through a chunked prefill", stats.get("num_prefilling", 0)),
                  ("kv_cache_usage_ratio", "share of KV pages in use", stats.get("kv_usage", 0.0)),
                  ("kv_free_pages", "free KV pages", stats.get("kv_free_pages", 0))]
        if "prefix_cache_pages" in stats:  # --enable-prefix-caching
            gauges.append(("prefix_cache_pages", "KV pages the prefix cache holds (those no request reads count as "
                           "free)", stats["prefix_cache_pages"]))
        lines = []
        for name, help_, v in gauges:
            lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} gauge", f"{p}_{name} {v}"]
        with self._lock:
            counters = [("retractions_total", "requests retracted under KV pressure", self.retractions),
                        ("prompt_tokens_total", "prompt tokens of requests that produced a token", self.prompt_tokens),
                        ("generation_tokens_total", "tokens generated", self.generation_tokens)]
            if "prefix_cache_hit_tokens" in stats:
                counters += [("prefix_cache_hit_tokens_total", "prompt tokens served from the prefix cache",
                              stats["prefix_cache_hit_tokens"]),
                             ("prefix_cache_queried_tokens_total", "prompt tokens looked up in the prefix cache",
                              stats["prefix_cache_queried_tokens"])]
            for name, help_, v in counters:
                lines += [f"# HELP {p}_{name} {help_}", f"# TYPE {p}_{name} counter", f"{p}_{name} {v}"]
            lines += [f"# HELP {p}_requests_finished_total requests finished, by reason",
                      f"# TYPE {p}_requests_finished_total counter"]
            lines += [f'{p}_requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(self.finished.items())]
            for h in (self.ttft, self.itl, self.tpot, self.e2e, self.prefill_step, self.decode_step):
                lines += h.render()
        return "\n".join(lines) + "\n"
