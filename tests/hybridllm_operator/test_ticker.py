"""The operator's one ticker for every LLMService's periodic jobs: a job runs when due, never
twice at once, again at once when poked (right after its pass, if it was running), and never
after it stopped; a job that raises is logged and looked at again later."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from hybridllm_operator.llmservice import jobs

GUARD_S = 10.0  # a failure guard only: every wait below ends on an event


class Probe(jobs.Job):
    what = "probe"

    def __init__(self, name: str, wait: float = 3600.0) -> None:
        state = jobs.ServiceState(("ns", name), None, None, list)  # type: ignore[arg-type]
        super().__init__(state, {}, {}, logging.getLogger("test"))  # type: ignore[arg-type]
        self.wait = wait
        self.passes = 0
        self.active = 0
        self.most_active = 0
        self.ran = asyncio.Event()
        self.hold: asyncio.Event | None = None  # set: passes wait for it
        self.fail = False

    async def __call__(self) -> float:
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            self.passes += 1
            self.ran.set()
            if self.hold is not None:
                await self.hold.wait()
            if self.fail:
                raise RuntimeError("a bug")
            return self.wait
        finally:
            self.active -= 1


async def _ran(job: Probe) -> None:
    await asyncio.wait_for(job.ran.wait(), GUARD_S)
    job.ran.clear()


def _run(test: Any) -> None:
    async def main() -> None:
        ticker = jobs.Ticker()
        for _ in range(3):  # every reconciler starts it: one loop runs
            ticker.start()
        try:
            await test(ticker)
        finally:
            ticker.stop()

    asyncio.run(main())


def test_the_ticker_runs_one_loop_however_often_it_is_started() -> None:
    async def main() -> None:
        ticker = jobs.Ticker()
        ticker.start()
        first = ticker.task
        for _ in range(100):
            ticker.start()
        loops = [
            t
            for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "") == "Ticker.run"
        ]
        assert ticker.task is first
        assert len(loops) == 1
        ticker.stop()

    asyncio.run(main())


def test_a_job_runs_when_due_and_again_when_poked() -> None:
    async def test(ticker: jobs.Ticker) -> None:
        job = Probe("a")  # next pass due in an hour
        ticker.add(job)
        await _ran(job)
        ticker.poke(job)
        await _ran(job)
        assert job.passes == 2

    _run(test)


def test_a_job_poked_while_it_runs_runs_once_more_after_never_beside_itself() -> None:
    async def test(ticker: jobs.Ticker) -> None:
        job = Probe("a")
        job.hold = asyncio.Event()
        ticker.add(job)
        await _ran(job)  # the first pass is under way, held
        for _ in range(3):
            ticker.poke(job)
        job.hold.set()
        await _ran(job)  # one more pass for the pokes, after the first
        assert job.most_active == 1
        assert job.passes == 2

    _run(test)


def test_a_stopped_job_never_runs_again_and_the_others_go_on() -> None:
    async def test(ticker: jobs.Ticker) -> None:
        gone, kept = Probe("gone", wait=0.0), Probe("kept", wait=0.0)
        for job in (gone, kept):
            ticker.add(job)
        await _ran(gone)
        gone.stopped = True
        ticker.poke(gone)
        passes = gone.passes
        for _ in range(5):  # the other job keeps running, pass after pass
            await _ran(kept)
        assert gone.passes == passes

    _run(test)


def test_a_job_that_raises_is_logged_and_looked_at_again(caplog: pytest.LogCaptureFixture) -> None:
    async def test(ticker: jobs.Ticker) -> None:
        job = Probe("broken")
        job.fail = True
        ticker.add(job)
        await _ran(job)
        job.fail = False
        ticker.poke(job)
        await _ran(job)
        assert job.passes == 2

    with caplog.at_level(logging.ERROR):
        _run(test)
    assert "probe of ns/broken failed" in caplog.text
