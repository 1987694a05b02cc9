"""runtime/background.py: jobs by shape key on one planner thread, taken when ready."""

from __future__ import annotations

import threading

import pytest

from swapsched.runtime.background import BackgroundPlans


def test_jobs_run_on_one_planner_thread_and_are_taken_once_each():
    plans = BackgroundPlans()
    threads = []

    def job(value):
        def run():
            threads.append(threading.current_thread().name)
            return value
        return run

    try:
        assert not plans
        plans.submit(1, "old-1", job("new-1"))
        plans.submit(2, "old-2", job("new-2"))
        plans.submit(2, "old-2b", job("new-2b"))  # a newer job for shape 2 supersedes the first
        assert plans
        assert sorted(plans.ready(wait=True)) == [(1, "old-1", "new-1"), (2, "old-2b", "new-2b")]
        assert not plans and list(plans.ready(wait=True)) == []
        assert len(set(threads)) == 1 and threads[0].startswith("swapsched-planner")
    finally:
        plans.shutdown()


def test_a_cleared_job_is_dropped_and_a_jobs_error_surfaces_in_the_caller():
    plans = BackgroundPlans()
    gate = threading.Event()
    try:
        plans.submit(1, "old", lambda: gate.wait() and "new")
        plans.clear()
        gate.set()
        assert not plans and list(plans.ready(wait=True)) == []

        def fails():
            raise ValueError("the policy failed")

        plans.submit(3, "old", fails)
        with pytest.raises(ValueError, match="the policy failed"):
            list(plans.ready(wait=True))
        assert not plans  # taken out before its error was raised
    finally:
        plans.shutdown()
