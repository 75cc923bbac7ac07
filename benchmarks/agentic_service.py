"""The tool service of `dagrl bench async --workload agentic`: a calculator behind HTTP on
127.0.0.1 that answers after a long-tailed latency, as a search API or a remote code sandbox
does, so that episodes spend much of their wall time waiting on their tool calls.

    POST /calculator  {"expression": "37*48+19"}  ->  {"result": "1795"}   (after the latency)
                      {"expression": "1+"}        ->  {"error": "'1+' is not an ..."}
    anything else (no JSON object, no expression, another path) -> HTTP 400 / 404

The answer is the real value (dagrl's calculator), so the task stays learnable. Each call's
latency is drawn from a seeded generator (`Latency`: lognormal by default, median 200 ms, p99
2 s), in the order the calls arrive; every answered call is recorded (drawn latency, and the
time from its arrival to its answer, which also holds the thread scheduling of a busy machine).
The server is threaded (one thread per call in flight, sleeping while it waits), so concurrent
calls overlap as they would on a real service.
"""

from __future__ import annotations

import json
import math
import random
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from statistics import NormalDist

from dagrl.tools import ToolError
from dagrl.tools.builtin import calculate

DISTRIBUTIONS = ("lognormal", "constant")
# The standard normal quantile at 0.99 (2.326): p99 = median * exp(Z99 * sigma) for a lognormal.
Z99 = NormalDist().inv_cdf(0.99)


@dataclass(frozen=True)
class Latency:
    """How long the service takes to answer a call, in milliseconds."""
    dist: str = "lognormal"
    median_ms: float = 200.0
    p99_ms: float = 2000.0      # lognormal only: sets the tail

    def __post_init__(self) -> None:
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"latency distribution {self.dist!r}: one of {DISTRIBUTIONS}")
        if self.median_ms < 0 or (self.dist == "lognormal" and
                                  not 0 < self.median_ms <= self.p99_ms):
            raise ValueError("latency: need 0 < median <= p99 (lognormal), median >= 0")

    @property
    def sigma(self) -> float:
        """The lognormal's shape, from its median and p99."""
        return math.log(self.p99_ms / self.median_ms) / Z99 if self.dist == "lognormal" else 0.0

    def quantile_ms(self, q: float) -> float:
        """The distribution's q-quantile (0 < q < 1)."""
        if self.dist == "constant":
            return self.median_ms
        return self.median_ms * math.exp(self.sigma * NormalDist().inv_cdf(q))

    def draw_ms(self, rng: random.Random) -> float:
        if self.dist == "constant":
            return self.median_ms
        return rng.lognormvariate(math.log(self.median_ms), self.sigma)

    def describe(self) -> str:
        if self.dist == "constant":
            return f"constant {self.median_ms:g} ms"
        return (f"lognormal, median {self.median_ms:g} ms, p90 {self.quantile_ms(0.9):.0f} ms, "
                f"p99 {self.p99_ms:g} ms (sigma {self.sigma:.3f}), mean "
                f"{self.median_ms * math.exp(self.sigma ** 2 / 2):.0f} ms")


def quantiles_ms(values: list[float], qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[float]:
    """Empirical quantiles (linear interpolation between order statistics)."""
    if not values:
        return [math.nan for _ in qs]
    ordered = sorted(values)
    out = []
    for q in qs:
        pos = q * (len(ordered) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))
    return out


@dataclass
class Call:
    drawn_ms: float      # the latency drawn for it
    served_ms: float     # arrival to answer, as the service measured it
    ok: bool             # answered with a result (not an error)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args) -> None:   # noqa: A002 (the base's signature)
        pass   # one line per call would flood the bench's output

    def _answer(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        arrived = time.perf_counter()
        if self.path != "/calculator":
            self._answer(404, {"error": f"no such endpoint {self.path}"})
            return
        try:
            arguments = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            expression = arguments["expression"]
            if not isinstance(expression, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            self._answer(400, {"error": 'expected a JSON object {"expression": "..."}'})
            return
        service = self.server.service
        drawn = service.begin()
        ok = False
        try:
            time.sleep(drawn / 1000)
            payload, ok = {"result": calculate(expression)}, True
        except ToolError as err:   # the policy's expression is wrong: the service worked
            payload = {"error": str(err).removeprefix("calculator: ")}
        finally:
            service.end(Call(drawn, (time.perf_counter() - arrived) * 1000, ok))
        self._answer(200, payload)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # A whole turn's calls connect at once; the default backlog (5) would drop connections and
    # add the kernel's retransmission delay (1 s) to the measured latency.
    request_queue_size = 1024
    service: ToolService

    def handle_error(self, request, client_address) -> None:
        # A client that timed out has closed its end: expected, not worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class ToolService:
    """The calculator service on 127.0.0.1 (a free port unless given), in a background thread.

        with ToolService(Latency(), seed=0) as service:
            url = service.url + "/calculator"
    """

    def __init__(self, latency: Latency, seed: int | str = 0, port: int = 0) -> None:
        # The policy's expressions are parsed with ast.parse, which warns on text such as `1e`;
        # one line per call would flood the bench's output (this runs in the bench's process).
        warnings.filterwarnings("ignore", category=SyntaxWarning)
        self.latency = latency
        self._lock = threading.Lock()
        self.reset(seed)
        self._server = _Server(("127.0.0.1", port), _Handler)
        self._server.service = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="agentic-tool-service")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def reset(self, seed: int | str) -> None:
        """Restart the latency draws from `seed` and forget the recorded calls (between the
        bench's runs, so both sides of a round draw the same sequence)."""
        with self._lock:
            self._rng = random.Random(seed)
            self._calls: list[Call] = []
            self._in_flight = 0
            self.peak_in_flight = 0   # calls being served at once, at most: the concurrency

    def begin(self) -> float:
        """A call arrives: its latency (ms), the next draw."""
        with self._lock:
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            return self.latency.draw_ms(self._rng)

    def end(self, call: Call) -> None:
        with self._lock:
            self._in_flight -= 1
            self._calls.append(call)

    def calls(self) -> list[Call]:
        with self._lock:
            return list(self._calls)

    def start(self) -> ToolService:
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ToolService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def summarize_calls(calls: list[Call]) -> dict:
    """Quantiles of the drawn and the served latencies of the answered calls, in ms."""
    drawn = quantiles_ms([c.drawn_ms for c in calls])
    served = quantiles_ms([c.served_ms for c in calls])
    return {"calls": len(calls), "errors": sum(not c.ok for c in calls),
            "drawn_ms": dict(zip(("p50", "p90", "p99"), drawn, strict=True)),
            "served_ms": dict(zip(("p50", "p90", "p99"), served, strict=True)),
            "served_max_ms": max((c.served_ms for c in calls), default=math.nan)}
