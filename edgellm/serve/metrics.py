"""What `edgellm serve` counts, exposed at GET /metrics in Prometheus' text format (prometheus_client).

Counters: requests finished (by finish reason: stop, length, cancelled, failed), prompt tokens
prefilled (a prefix reused from a slot's cache is not), tokens generated, decode steps and the
sequences they carried, and seconds of one-time work (kernels compiled, CUDA graphs captured: on
a GPU, what a stall is made of when it happens after the warmup). Gauges (read when scraped): slots busy, requests waiting. Two histograms
say whether the server stalls, and where:

- edgellm_scheduler_interval_seconds: the time between the starts of consecutive iterations of
  the model thread while requests run (a decode step, with any prefill chunk and the delivery of
  the previous step's tokens). Steady decoding puts every observation near the step time; a
  stall of the model thread or the device (a compile, a capture, a collection) is one far out.
- edgellm_event_loop_lag_seconds: how late the event loop runs a timer it set EVENT_LOOP_PERIOD
  ahead. Streams leave through that loop: when it stalls, clients stop receiving although the
  model thread goes on.

A load test reads both before and after a round (benchmarks/bench_serve.py) and reports the
observations past STALL_S. Each app has its own registry, so several servers in one process (the
tests) do not share counts.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# seconds; a decode step of the models served takes 1-10 ms on a GPU, 10-100 ms on a CPU
INTERVAL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
EVENT_LOOP_PERIOD = 0.05
STALL_S = 0.1  # what a load test reports as a stall
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The registry of one server. Counts come from the scheduler's plain counters (its `stats`:
    an int increment on the model thread, read here when scraped); the histograms are observed
    as things happen (once a scheduler iteration, once a timer period)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.interval = Histogram("edgellm_scheduler_interval_seconds", "Time between the starts of consecutive "
                                  "model-thread iterations while requests run", buckets=INTERVAL_BUCKETS, registry=r)
        self.loop_lag = Histogram("edgellm_event_loop_lag_seconds", "How late the event loop ran a timer set "
                                  f"{EVENT_LOOP_PERIOD} s ahead", buckets=INTERVAL_BUCKETS, registry=r)

    def watch(self, stats: dict, counts, one_time=None) -> None:
        """Export the scheduler's counters (stats: {name: int}, 'requests_REASON' per finish reason),
        gauges (counts(): busy and waiting) and one_time() (seconds of kernel compiles and graph
        captures) when scraped."""
        self.registry.register(_SchedulerCollector(stats, counts, one_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def watch_event_loop(self) -> None:
        """Observe the running loop's lag until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(EVENT_LOOP_PERIOD)
            self.loop_lag.observe(max(0.0, loop.time() - t - EVENT_LOOP_PERIOD))


class _SchedulerCollector:
    COUNTERS = {"prompt_tokens": "Prompt tokens prefilled (not those reused from a slot's cache)",
                "generated_tokens": "Tokens generated",
                "decode_steps": "Decode steps",
                "decode_rows": "Sequences carried by the decode steps"}

    def __init__(self, stats: dict, counts, one_time=None):
        self.stats, self.counts, self.one_time = stats, counts, one_time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = dict(self.stats)  # a copy: the model thread goes on counting
        for name, doc in self.COUNTERS.items():
            yield CounterMetricFamily(f"edgellm_{name}", doc, value=stats.get(name, 0))
        finished = CounterMetricFamily("edgellm_requests", "Requests finished, by finish reason", labels=["reason"])
        for reason in ("stop", "length", "cancelled", "failed"):
            finished.add_metric([reason], stats.get(f"requests_{reason}", 0))
        yield finished
        if self.one_time is not None:
            yield CounterMetricFamily("edgellm_one_time_seconds", "Seconds the model's programs spent on one-time "
                                      "work: kernels compiled or loaded, CUDA graphs captured", value=self.one_time())
        c = self.counts()
        yield GaugeMetricFamily("edgellm_slots_busy", "Slots holding a request", value=c["busy"])
        yield GaugeMetricFamily("edgellm_requests_waiting", "Requests waiting for a slot", value=c["waiting"])


def parse(text: str) -> dict[str, float]:
    """A scrape as {sample name with its labels: value}, e.g. 'edgellm_generated_tokens_total',
    'edgellm_requests_total{reason="stop"}', 'edgellm_scheduler_interval_seconds_bucket{le="0.1"}'."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def past(before: dict[str, float], after: dict[str, float], histogram: str, bound: float = STALL_S) -> tuple[int, str]:
    """Observations of a histogram between two scrapes (parse) above `bound`, and the range of the
    highest bucket that got any ('' if none): how many stalls, and how long the longest was."""
    def buckets(d):  # {upper bound: cumulative count}
        prefix = histogram + '_bucket{le="'
        return {float(k[len(prefix):-2]): v for k, v in d.items() if k.startswith(prefix)}

    b0, b1 = buckets(before), buckets(after)
    new = {b: b1[b] - b0.get(b, 0.0) for b in sorted(b1)}  # cumulative, between the scrapes
    total = new.get(float("inf"), 0.0)
    under = max((v for b, v in new.items() if b <= bound), default=0.0)
    worst, below, lower = "", 0.0, 0.0
    for b, v in new.items():
        if v > below:
            worst = f"{lower:g}-{b:g} s" if b != float("inf") else f"> {lower:g} s"
        below, lower = v, b
    return int(round(total - under)), worst
