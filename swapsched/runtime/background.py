"""Plans made on a thread while training runs: one job per shape, on one planner thread.

The runtime borrows a plan for a new shape at once and has the policy plan that shape here,
beside the training step (see ``ShapePlans.plan_later``); a job reads only what it was given,
so it may run there. The runtime takes each layout when it is ready and puts it in place of the
one it was made to replace, unless that one has gone since.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from swapsched.runtime.layout import PlanLayout
from swapsched.runtime.worker_threads import one_torch_thread

__all__ = ["BackgroundPlans"]


@dataclass(frozen=True)
class _Pending:
    """A layout being made on the planner thread, to replace ``replaces``."""

    future: Future[PlanLayout]
    replaces: PlanLayout


class BackgroundPlans:
    """The jobs in flight, by shape key (a newer job for a shape supersedes the older one's
    result); the thread starts with the first job."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: dict[int, _Pending] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def __contains__(self, key: int) -> bool:
        """Whether a job for the shape ``key`` is in flight."""
        return key in self._pending

    def submit(self, key: int, replaces: PlanLayout, job: Callable[[], PlanLayout]) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swapsched-planner",
                                                initializer=one_torch_thread)  # worker_threads.py
        self._pending[key] = _Pending(self._executor.submit(job), replaces)

    def ready(self, wait: bool = False) -> Iterator[tuple[int, PlanLayout, PlanLayout]]:
        """(shape key, the layout it replaces, the new layout) for every job done (every job, with
        ``wait``); each is taken out as it is given. A job's error surfaces here, in the caller's
        thread: the training loop's."""
        for key, pending in list(self._pending.items()):
            if not (wait or pending.future.done()):
                continue
            del self._pending[key]
            yield key, pending.replaces, pending.future.result()

    def clear(self) -> None:
        """Forget the jobs in flight: their layouts are dropped when they finish."""
        self._pending.clear()

    def shutdown(self) -> None:
        """Stop the planner thread; jobs not started are cancelled."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()
