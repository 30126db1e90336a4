"""Where a daemon's tensor work runs: one thread, in submission order; the main thread by default.

Why: torch's CPU kernels ran a 10-layer SmolLM2 decode step in ~12 ms on the process's main
thread but 18-30 ms on a worker thread here (its OpenMP pool serves the main thread best), so a
daemon runs trio in a second thread and feeds the main thread tensor jobs through this executor.
Running every job on one thread also serialises KV bookkeeping without locks.
"""

from __future__ import annotations

import queue
import threading
import time
from functools import partial
from typing import Any, Callable

import outcome
import trio

_STOP = object()


class ComputeExecutor:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # seconds spent in jobs that ended, and when the job running now began (None: none runs); one
        # tuple, so a reader on another thread sees both of the same moment
        self._busy: tuple[float, float | None] = (0.0, None)
        self._thread: threading.Thread | None = None

    def serve(self, poll_s: float = 0.2) -> None:
        """Run jobs on the calling thread until `stop()`; returns between jobs so signals get handled."""
        while True:
            try:
                job = self._jobs.get(timeout=poll_s)
            except queue.Empty:
                continue
            if job is _STOP:
                return
            fn, deliver = job
            done, t0 = self._busy[0], time.perf_counter()
            self._busy = (done, t0)
            result = outcome.capture(fn)
            self._busy = (done + time.perf_counter() - t0, None)
            deliver(result)

    def start_thread(self, name: str = "meshd-compute") -> "ComputeExecutor":
        """Serve jobs on a new background thread instead (tests, `meshd local`)."""
        self._thread = threading.Thread(target=self.serve, name=name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._jobs.put(_STOP)

    @property
    def busy_s(self) -> float:
        """Seconds spent running jobs, the one running now included (a decode run is one job of many
        steps: the figure grows while it runs, not only when it ends)."""
        done, since = self._busy
        return done + (time.perf_counter() - since if since is not None else 0.0)

    def waiting(self) -> bool:
        """Whether a job waits for the thread (safe from any thread)."""
        return not self._jobs.empty()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on the compute thread and return its result (or raise its error).

        A started job cannot be interrupted, so the wait is shielded: a cancelled caller still
        waits for the job to finish (bounded by one forward pass) and nothing runs concurrently.
        """
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: list[outcome.Outcome] = []

        def deliver(result: outcome.Outcome) -> None:
            box.append(result)
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self._jobs.put((partial(fn, *args), deliver))
        with trio.CancelScope(shield=True):
            await done.wait()
        return box[0].unwrap()
