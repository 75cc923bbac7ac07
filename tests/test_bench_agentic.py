"""`dagrl bench async --workload agentic`: the tool service's seeded latency distribution, its
answers through the `http` tool under concurrent calls, and one tiny run of the whole bench
(sync beside async, multi-turn episodes calling the service)."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import random
from pathlib import Path

import pytest

from benchmarks.agentic_service import Latency, ToolService, quantiles_ms, summarize_calls
from dagrl.config.multi_turn import HttpToolConfig, MultiTurnConfig
from dagrl.tools import ToolError, load_tools

bench = importlib.import_module("benchmarks.async")   # `async` is a keyword

EXPRESSION = {"type": "object", "properties": {"expression": {"type": "string"}},
              "required": ["expression"]}


def calculator(service: ToolService, calls: int = 8, timeout_s: float = 10.0):
    cfg = MultiTurnConfig(tools=["http"], max_concurrent_calls=calls, tool_timeout_s=timeout_s,
                          http=HttpToolConfig(url=service.url + "/calculator", name="calculator",
                                              parameters=EXPRESSION))
    return load_tools(["http"], cfg)["calculator"]


def test_latency_draws_follow_the_configured_lognormal():
    latency = Latency()   # the bench's default: median 200 ms, p99 2 s
    assert latency.sigma == pytest.approx(math.log(10) / 2.3263, rel=1e-4)
    assert latency.quantile_ms(0.5) == pytest.approx(200)
    assert latency.quantile_ms(0.99) == pytest.approx(2000)
    rng = random.Random(0)
    draws = [latency.draw_ms(rng) for _ in range(40_000)]
    p50, p90, p99 = quantiles_ms(draws)
    assert p50 == pytest.approx(200, rel=0.03)
    assert p90 == pytest.approx(latency.quantile_ms(0.9), rel=0.04)
    assert p99 == pytest.approx(2000, rel=0.08)
    again = random.Random(0)   # seeded: the same sequence
    assert [latency.draw_ms(again) for _ in range(5)] == draws[:5]
    assert Latency("constant", 50).draw_ms(rng) == 50
    assert "p99 2000 ms (sigma 0.990)" in latency.describe()
    for bad in (("lognormal", 300, 200), ("lognormal", 0, 10), ("gamma", 1, 2)):
        with pytest.raises(ValueError):
            Latency(*bad)


def test_the_service_answers_concurrent_calls_with_its_seeded_draws():
    latency = Latency("lognormal", 2, 20)   # short: the test checks draws, not wall-clock time
    with ToolService(latency, seed=3) as service:
        tool = calculator(service, calls=16)

        async def batch() -> list[str]:
            return await asyncio.gather(*(tool.call({"expression": f"{i}*7+1"})
                                          for i in range(16)))

        assert asyncio.run(batch()) == [str(i * 7 + 1) for i in range(16)]
        calls = service.calls()
        rng = random.Random(3)   # the calls took the first 16 draws, in their arrival order
        assert sorted(c.drawn_ms for c in calls) == sorted(latency.draw_ms(rng)
                                                           for _ in range(16))
        assert all(c.ok and c.served_ms >= c.drawn_ms for c in calls)
        assert service.peak_in_flight > 1   # served at once, not one after another
        with pytest.raises(ToolError, match=r"calculator: '1\+' is not an arithmetic"):
            asyncio.run(tool.call({"expression": "1+"}))
        summary = summarize_calls(service.calls())
        assert summary["calls"] == 17 and summary["errors"] == 1
        service.reset(3)   # the next run starts from the same draws
        assert service.calls() == [] and service.begin() == latency.draw_ms(random.Random(3))


def test_a_call_slower_than_its_timeout_is_a_tool_error():
    with ToolService(Latency("constant", 3000)) as service:
        tool = calculator(service, timeout_s=0.2)
        with pytest.raises(ToolError, match="calculator: no result within 0.2 s"):
            asyncio.run(tool.call({"expression": "1+1"}))


@pytest.mark.slow
def test_the_bench_runs_sync_beside_async_on_the_agentic_workload(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert bench.main(["--workload", "agentic", "--steps", "2", "--warmup", "1", "--rounds", "1",
                       "--prompts", "2", "--samples", "2", "--hidden", "32", "--layers", "1",
                       "--max-new-tokens", "16", "--latency-median-ms", "5",
                       "--latency-p99-ms", "50", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tool latency, configured: lognormal, median 5 ms" in out
    assert "tool latency, measured over the" in out
    assert "async / sync: " in out and "staleness max" in out
    args = bench.side_args("async", bench.parse_args(["--workload", "agentic"]), tmp_path)
    assert "rollout.multi_turn.tools=[http]" in args and "trainer.mode=async" in args
    # The trainer rank takes the core the rollout rank leaves idle while its episodes wait.
    assert "trainer.async_trainer_threads=2" in args
    assert "async: the trainer rank 2 threads, OMP_WAIT_POLICY=" in out
    for side in ("sync", "async"):   # both sides ran and logged their steps
        assert (tmp_path / f"{side}-0" / "metrics.jsonl").is_file()
    # The rollout rank asked every step whether the next batch could start early.
    first = json.loads((tmp_path / "async-0" / "metrics.jsonl").read_text().splitlines()[0])
    assert "multi_turn/started_ahead" in first


def test_the_bench_refuses_run_directories_of_an_earlier_bench(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    # They would be resumed, and their old steps read as this bench's.
    (tmp_path / "async-0").mkdir()
    assert bench.main(["--workload", "agentic", "--rounds", "1", "--out", str(tmp_path)]) == 2
    assert "async-0 exist(s) from an earlier bench" in capsys.readouterr().err
