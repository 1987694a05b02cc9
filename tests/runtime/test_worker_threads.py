"""The runtime's own threads run torch's ops on one thread each, and leave every other thread's count."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from swapsched.runtime.background import BackgroundPlans
from swapsched.runtime.copy_engine import CopyEngine, Ticket
from swapsched.runtime.worker_threads import one_torch_thread


def _count_on_new_thread() -> int:
    """The thread count a thread that has run no torch op yet starts with (the process-wide figure)."""
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_one_torch_thread_sets_the_calling_thread_alone():
    main = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=one_torch_thread) as pool:
        on_worker = pool.submit(torch.get_num_threads).result()
        assert on_worker == 1
        # while the worker lives: the loop's thread and threads made later keep the count
        assert torch.get_num_threads() == main
        assert _count_on_new_thread() == main


def test_a_copy_engine_copies_on_one_thread_and_the_training_loop_keeps_its_count():
    main = torch.get_num_threads()
    engine = CopyEngine("test-engine", None, 0.0)
    seen: list[int] = []
    src = torch.randn(1 << 20)
    dst = torch.empty_like(src)
    t = Ticket(src.nbytes, src, dst, done_event=threading.Event())
    engine.submit(t, lambda: (seen.append(torch.get_num_threads()), dst.copy_(src)))
    t.done_event.wait(10)
    engine.stop()
    engine.join(10)
    assert seen == [1]
    assert torch.equal(src, dst)
    assert torch.get_num_threads() == main
    assert _count_on_new_thread() == main


def test_the_background_planner_runs_on_one_torch_thread():
    plans = BackgroundPlans()
    try:
        plans.submit(0, None, torch.get_num_threads)  # type: ignore[arg-type]  # a job returns its layout
        ((_, _, count),) = plans.ready(wait=True)
        assert count == 1
    finally:
        plans.shutdown()
