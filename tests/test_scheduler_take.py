"""The scheduler's hand-over of queued jobs to the thread that read them (``take_idle``): the
daemon's I/O and lanes' threads run a quick model's jobs themselves after a pass, instead of its
workers, but never beside a worker running the model, and never past a re-plan waiting for its
gate. Real scheduler and gate; the jobs run nothing (the scheduler is above the runtime)."""
from __future__ import annotations

import threading
import time

from vkpool.daemon.registry import SharedGate
from vkpool.daemon.scheduler import Job, Scheduler


def _job(i: int, answered: list, priority: int = 0) -> Job:
    return Job(client=b"c%d" % (i % 2), request_id=f"r{i}", model_id="m", feeds={}, outputs=None,
               priority=priority, deadline=None, finish_cb=lambda job, status, content, frames: answered.append(
                   (job.request_id, threading.current_thread().name)))


def _scheduler(ran: list) -> Scheduler:
    def run_job(job: Job) -> None:  # what the daemon's workers do with a job: answer it
        ran.append(job.request_id)
        job.finish("ok", {})

    s = Scheduler(queue_limit=64, max_queued=64, workers_per_model=1, run_job=run_job)
    s.add_model("m")
    return s


def test_queued_jobs_go_to_the_reading_thread_in_queue_order_with_the_gate_held() -> None:
    answered: list = []
    ran: list = []
    s = _scheduler(ran)
    gate = SharedGate()
    try:
        jobs = [_job(i, answered, priority=1 if i == 3 else 0) for i in range(5)]
        for job in jobs:
            s.submit(job, wake=False)  # held: the workers are not told
        jobs[1].fail("Cancelled", "cancelled while queued")  # left out when taken
        taken = s.take_idle("m", 3, gate)
        assert taken is not None
        # the highest priority first, then the clients in rotation; the cancelled one skipped
        assert [j.request_id for j in taken][0] == "r3" and "r1" not in [j.request_id for j in taken]
        assert len(taken) == 3 and all(j.state == "running" for j in taken)
        assert gate._readers == 1  # held for the caller while it runs them
        assert s.counts("m")[1] == 3
        s.run_taken(taken, lambda batch: [job.finish("ok", {}) for job in batch])
        gate.release_shared()
        assert s.counts("m")[1] == 0
        # what stayed queued was handed to the workers, which answer it
        deadline = time.monotonic() + 10
        while len(answered) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(a[0] for a in answered) == [f"r{i}" for i in range(5)]
        assert [name for rid, name in answered if rid in ran] and all(
            name.startswith("vkpool-worker") for rid, name in answered if rid in ran)
    finally:
        s.remove_model("m")


def test_nothing_is_taken_beside_a_worker_or_past_a_replan_waiting_for_the_gate() -> None:
    answered: list = []
    release = threading.Event()
    started = threading.Event()

    def run_job(job: Job) -> None:  # a worker's job that runs until told
        started.set()
        release.wait(10)
        job.finish("ok", {})

    s = Scheduler(queue_limit=64, max_queued=64, workers_per_model=1, run_job=run_job)
    s.add_model("m")
    gate = SharedGate()
    try:
        s.submit(_job(0, answered))  # the worker takes it and runs
        assert started.wait(10)
        s.submit(_job(1, answered), wake=False)
        assert s.take_idle("m", 8, gate) is None  # a worker runs the model: the job stays its
        assert gate._readers == 0
        release.set()
        deadline = time.monotonic() + 10
        while len(answered) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(answered) == 2  # the worker was told of the job left queued

        # a re-plan waits for the gate: nothing is taken, nothing held
        reader = SharedGate()
        reader.acquire_shared()  # a run in progress
        replan = threading.Thread(target=reader.acquire_exclusive)
        replan.start()
        deadline = time.monotonic() + 10
        while not reader._writer and time.monotonic() < deadline:
            time.sleep(0.001)
        release.clear()
        started.clear()
        s.submit(_job(2, answered), wake=False)
        assert s.take_idle("m", 8, reader) is None
        assert reader._readers == 1  # only the run in progress
        reader.release_shared()
        replan.join(10)
        reader.release_exclusive()
        release.set()
        deadline = time.monotonic() + 10
        while len(answered) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(answered) == 3

        # nothing queued: None, and the gate is not kept
        assert s.take_idle("m", 8, gate) is None and gate._readers == 0
    finally:
        release.set()
        s.remove_model("m")
