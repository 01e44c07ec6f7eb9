"""The thread governor: fewer kernel threads while the machine is too busy for all of them,
all of them again when it is not (coli/threads.py), and an engine whose results do not
depend on which."""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

import coli
from tests.test_errors import assert_one_line_error, coli_cli
from coli import synthetic
from coli._engine import kernels as K
from coli.errors import InvalidRequestError
from coli.threads import (FIRST_AFTER, FIRST_TRIAL, LOSE_EARLY, MAX_AFTER, MAX_UP_AFTER, WINDOW, ComputeThreads,
                          ThreadGovernor, enabled)


class Machine:
    """Step times by thread count; ``busy`` switches to the times of a machine whose cores
    are taken by other work (more threads: far slower, every barrier waits for a core)."""

    def __init__(self, quiet: dict[int, float], busy: dict[int, float]):
        self.quiet, self.busy_times, self.busy = quiet, busy, False
        self.n = max(quiet)
        self.history: list[int] = []

    def set(self, n: int) -> None:
        self.n = n

    def run(self, gov: ThreadGovernor, steps: int, tokens: int = 1) -> None:
        for _ in range(steps):
            t = (self.busy_times if self.busy else self.quiet)[self.n]
            self.history.append(self.n)
            gov.observe(tokens, t * (1 + 0.1 * (tokens - 1)))  # a batch reads the weights once for all


def governed(quiet, busy, max_threads=2):
    m = Machine(quiet, busy)
    return m, ThreadGovernor(max_threads, m.set)


QUIET = {2: 0.009, 1: 0.015}  # two threads 1.6x faster than one
BUSY = {2: 0.5, 1: 0.05}  # two threads 10x slower than one: every barrier waits for a time slice


def test_a_quiet_machine_keeps_every_thread_and_tries_fewer_ever_more_rarely():
    m, gov = governed(QUIET, BUSY)
    rng = np.random.default_rng(0)
    for _ in range(20000):  # step times that vary by ~30% from step to step
        m.history.append(m.n)
        gov.observe(1, QUIET[m.n] * float(rng.lognormal(0.0, 0.3)))
    assert gov.n == 2 and gov.switches == 0
    assert m.history.count(1) < 0.01 * len(m.history)  # the trials' cost
    assert gov.after == MAX_AFTER  # each lost trial doubled the wait
    assert gov.trials <= 2 + (20000 - FIRST_AFTER) // FIRST_AFTER


def test_a_machine_that_gets_busy_goes_to_one_thread_within_a_few_windows():
    m, gov = governed(QUIET, BUSY)
    m.run(gov, 100)
    m.busy = True
    m.run(gov, 3 * WINDOW)  # the stall shows in the first slow window: a trial, then the switch
    assert gov.n == 1 and gov.switches == 1
    m.run(gov, 2000)
    assert gov.n == 1
    # trials of two threads again are abandoned at their first (slow) step, ever more rarely
    tried = m.history[100 + 3 * WINDOW:].count(2)
    assert 0 < tried <= gov.trials and tried < 12
    m.run(gov, 20000)
    assert gov.after == MAX_UP_AFTER  # but not so rarely that a quiet machine goes unnoticed for long
    m.busy = False
    m.run(gov, MAX_UP_AFTER + 2 * WINDOW)
    assert gov.n == 2


def test_busy_from_the_start_is_found_by_the_early_trial():
    m, gov = governed(QUIET, BUSY)
    m.busy = True
    m.run(gov, FIRST_TRIAL + WINDOW)
    assert gov.n == 1 and gov.trials == 1
    assert m.history.count(2) == FIRST_TRIAL  # the slow steps it took to find out


def test_a_quiet_machine_loses_the_early_trial_and_waits_the_full_first_after():
    m, gov = governed(QUIET, BUSY)
    m.run(gov, FIRST_TRIAL + LOSE_EARLY)
    # the trial's first steps were all slower than two threads' pace: it ended there
    assert gov.n == 2 and gov.trials == 1 and gov.trial is None and gov.after == FIRST_AFTER
    assert m.history.count(1) == LOSE_EARLY
    m.run(gov, FIRST_AFTER - 1)
    assert gov.trials == 1
    m.run(gov, 1)
    assert gov.trials == 2


def test_a_trial_of_fewer_threads_with_one_fast_first_step_runs_its_window():
    """Ending early takes every one of the first LOSE_EARLY steps slower: one at least as fast
    as the current pace and the trial is judged on its whole window, as before."""
    m, gov = governed(QUIET, BUSY)
    m.run(gov, FIRST_TRIAL)
    assert gov.trial is not None and gov.active == 1
    gov.observe(1, QUIET[2] * 0.9)  # a fast first step at one thread
    m.run(gov, LOSE_EARLY)
    assert gov.trial is not None  # still running
    m.run(gov, WINDOW - 1 - LOSE_EARLY)
    assert gov.trial is None and gov.n == 2 and gov.trials == 1


def test_when_the_machine_is_quiet_again_every_thread_comes_back():
    m, gov = governed(QUIET, BUSY)
    m.busy = True
    m.run(gov, FIRST_TRIAL + WINDOW)
    assert gov.n == 1
    m.busy = False
    m.run(gov, 200)
    assert gov.n == 2 and gov.switches == 2


def test_steps_that_slow_down_for_other_reasons_do_not_keep_trials_coming():
    """A growing context makes every step dearer whatever the threads: after one lost trial
    that pace is the norm, so the stall check does not fire every window."""
    m, gov = governed({2: 0.009, 1: 0.015}, {2: 0.03, 1: 0.05})  # 3.3x slower, threads still pay
    m.run(gov, 100)
    m.busy = True
    m.run(gov, 1000)
    assert gov.n == 2 and gov.trials <= 3


def test_prefill_chunks_are_not_timed():
    m, gov = governed(QUIET, BUSY)
    m.busy = True
    m.run(gov, 5000, tokens=256)
    assert gov.trials == 0 and not gov.recent


def test_a_trial_is_for_the_timed_steps_and_a_prefill_keeps_the_count_kept():
    """A trial of fewer threads that begins just before a long prompt would run the whole
    prefill (steps the governor does not time, so the trial goes on) with its count."""
    m, gov = governed(QUIET, BUSY)
    m.run(gov, FIRST_TRIAL)  # the early trial of one thread starts after these
    assert gov.trial is not None and gov.active == 1
    assert gov.for_step(1) == gov.for_step(16) == 1
    assert gov.for_step(17) == gov.for_step(256) == 2
    gov.n = 1  # a count kept (a busy machine): every step runs with it
    gov.trial = None
    assert gov.for_step(1) == gov.for_step(256) == 1


def test_batches_of_changing_size_are_no_stall():
    """One stream, then four, then one again, on a quiet machine: four tokens a step cost less
    per token than one, and the sizes are compared only with themselves."""
    m, gov = governed(QUIET, BUSY)
    for _ in range(10):
        m.run(gov, 40, tokens=4)
        m.run(gov, 40, tokens=1)
    # only the early trial and the periodic ones (after 256 timed steps, then 512 more), none
    # for a stall
    assert gov.n == 2 and gov.switches == 0 and gov.trials == 3
    m.busy = True
    m.run(gov, 3 * WINDOW, tokens=4)  # a real stall of the 4-token steps is still seen
    assert gov.n == 1


def test_one_thread_and_the_switch_off():
    gov = ThreadGovernor(1, lambda n: pytest.fail("one thread has nothing to change"))
    for _ in range(1000):
        gov.observe(1, 0.01)
    assert not enabled({"COLI_ADAPTIVE_THREADS": "0"}) and enabled({}) and enabled({"COLI_ADAPTIVE_THREADS": "1"})
    with pytest.raises(InvalidRequestError, match="COLI_ADAPTIVE_THREADS='maybe' must be 1"):
        enabled({"COLI_ADAPTIVE_THREADS": "maybe"})


def test_a_bad_switch_is_one_line_on_the_command_line(monkeypatch):
    monkeypatch.setenv("COLI_ADAPTIVE_THREADS", "maybe")
    r = coli_cli("run", "--threads", "2", "-n", "2", "hi")
    assert_one_line_error(r, "COLI_ADAPTIVE_THREADS='maybe' must be 1 (on, the default) or 0 (off)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synthetic.write_converted("tiny", tmp_path_factory.mktemp("threads") / "tiny-int4", "int4", seed=0)


def test_engine_logits_do_not_depend_on_the_threads_the_governor_picks(tiny, monkeypatch):
    m = coli.load(tiny, threads=2)
    eng = m.engine
    assert eng.governor is not None and eng.threads_in_use == 2
    runs = []
    for n in (2, 1, 2):  # what the governor may do between steps
        eng.governor.n = n
        cache = eng.new_cache(64)
        out = [eng.step([(cache, list(range(2, 20)))]).copy()]
        assert K.get_num_threads() == n
        for tok in (3, 5, 7):
            out.append(eng.step([(cache, [tok])]).copy())
        runs.append(out)
    for a, b in zip(runs[0], runs[1]):
        np.testing.assert_array_equal(a, b)
    eng.governor.n = 2
    eng.governor.trial = (1, {})  # a trial of one thread under way: decode steps run with it ...
    cache = eng.new_cache(64)
    used, forward = [], eng.model.forward

    def counted(*a, **kw):  # the threads a step computes with (after it, the governor may end the trial)
        used.append(K.get_num_threads())
        return forward(*a, **kw)

    monkeypatch.setattr(eng.model, "forward", counted)
    eng.step([(cache, list(range(2, 40)))])
    eng.step([(cache, [3])])
    assert used == [2, 1]  # ... a prompt's prefill with the count kept
    monkeypatch.undo()
    eng.governor.trial = None
    m.close()
    monkeypatch.setenv("COLI_ADAPTIVE_THREADS", "0")
    m = coli.load(tiny, threads=2)
    assert m.engine.governor is None and m.engine.threads_in_use == 2
    m.close()


def _in_thread(fn, *args) -> threading.Thread:
    t = threading.Thread(target=fn, args=args)
    t.start()
    t.join()
    return t


def test_a_second_live_compute_thread_is_reported_once_and_an_ended_one_is_not():
    """Two live threads that have run kernels hold two OpenMP teams (libgomp then sleeps at
    every barrier once its threads outnumber the CPUs): said once; a thread that ran the model
    and ended took its team with it, so the next one is no second team."""
    many = len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1
    said: list[str] = []
    ct = ComputeThreads(warn=said.append)
    for _ in range(3):
        _in_thread(ct.note, many)  # one thread after another, each ended before the next: one team at a time
    ct.note(1)  # the main thread, one kernel thread: no team of workers
    assert said == []
    ct.note(many)  # the main thread with many, while no other lives
    assert said == []
    ready, done = threading.Event(), threading.Event()

    def runner():  # a second thread that computes and stays alive, as a Runner's does
        ct.note(many)
        ready.set()
        done.wait(10)

    t = threading.Thread(target=runner, name="second")
    t.start()
    ready.wait(10)
    ct.note(many)  # the main thread again, the other alive
    done.set()
    t.join()
    assert len(said) == 1 and "'second'" in said[0] and "one thread" in said[0]
    ct.note(many)
    _in_thread(ct.note, many)
    assert len(said) == 1  # once per process


def test_the_engine_reports_a_second_compute_thread(tiny, monkeypatch):
    """Through the engine: threads that step the model one after another are no second team;
    a second thread stepping it while the main thread (which has) lives is, with two kernel
    threads on a machine of at most two CPUs (with more, libgomp keeps spinning)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    said: list[str] = []
    import coli.engine as E

    monkeypatch.setattr(E, "compute_threads", ComputeThreads(warn=said.append))
    m = coli.load(tiny, threads=2)
    eng = m.engine
    hold = threading.Event()
    errs: list[BaseException] = []

    def step():
        try:
            eng.step([(eng.new_cache(16), [2, 3])])
        except BaseException as e:  # noqa: BLE001 (reported below)
            errs.append(e)

    for _ in range(2):  # threads that step and end, one after the other: one team at a time
        t = threading.Thread(target=step)
        t.start()
        t.join()
    eng.step([(eng.new_cache(16), [2, 3])])  # then the main thread
    assert not errs and said == []
    done = threading.Event()

    def lingering():
        eng.step([(eng.new_cache(16), [2, 3])])
        hold.set()
        done.wait(10)

    t = threading.Thread(target=lingering)
    t.start()
    hold.wait(10)
    eng.step([(eng.new_cache(16), [2, 3])])
    done.set()
    t.join()
    m.close()
    if cpus <= 2:
        assert len(said) == 1 and "OpenMP" in said[0]
    else:
        assert said == []


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_an_idle_runner_and_a_finished_generate_retire_their_openmp_workers(tiny, monkeypatch):
    """Two live runners of one model, used in turn, and Model.generate on the main thread
    before them: each retires its OpenMP workers when it is done, so the thread computing next
    is the only team (no second one, no warning), and the workers' threads are gone."""
    if not K.has_openmp():
        pytest.skip("this build has no OpenMP (single-threaded kernels)")
    from coli.runner import Runner
    import coli.engine as E

    said: list[str] = []
    monkeypatch.setattr(E, "compute_threads", ComputeThreads(warn=said.append))
    m = coli.load(tiny, threads=2)
    for _ in m.generate("hello", max_tokens=4, temperature=0):  # on the main thread, which retires its workers after
        pass
    ids = m.tokenizer.encode("the quick brown fox")
    with Runner(m, persist=False) as r1, Runner(m, persist=False) as r2:
        for r in (r1, r2, r1, r2):
            r.submit(ids, max_tokens=6).result(60)
            deadline = time.monotonic() + 10
            while r._team and time.monotonic() < deadline:  # until its loop finds no work and retires them
                time.sleep(0.005)
            assert not r._team
        idle = _tasks()
        r1.submit(ids, max_tokens=6).result(60)  # a fresh worker for the step ...
        deadline = time.monotonic() + 10
        while (r1._team or _tasks() > idle) and time.monotonic() < deadline:  # ... retired again (it ends a moment later)
            time.sleep(0.01)
        assert _tasks() == idle
    assert said == []
    m.close()


def _pin_every_thread(cpus) -> None:
    """sched_setaffinity(0) pins only the calling thread (and threads it starts later)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that has ended since
            pass


def _spin(stop) -> None:
    while not stop.is_set():
        pass


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and 2 CPUs")
def test_real_contention_moves_the_engine_to_one_thread(tiny):
    """Two kernel threads and a busy-looping process on one CPU (real processes, pinned; what
    a container's quota of one core does to ``--threads 2``): at every barrier one thread
    spins while the other waits for the CPU, and a step takes ~100x one thread's. The
    governor's early trial finds that one thread is faster. Bounded: at most ~20 s of steps.

    (Four busy processes on two CPUs were not enough: this host's scheduler often gave the
    engine's threads both CPUs, and two threads then stayed the faster.) The tiny model's
    matrices are below the size at which a kernel wakes its team, so SMALL_WORK is lowered
    until a step forks a few times: otherwise the thread count would not matter at all."""
    cpu = sorted(os.sched_getaffinity(0))[:1]
    saved = os.sched_getaffinity(0)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    hog = ctx.Process(target=_spin, args=(stop,), daemon=True)
    K.set_small_work(8192)  # a step of the tiny model: a few parallel regions, each a barrier
    try:
        m = coli.load(tiny, threads=2)
        eng = m.engine
        cache = eng.new_cache(4096)
        eng.step([(cache, [2, 3, 4])])
        t = time.perf_counter()
        eng.step([(cache, [5])])
        quiet = time.perf_counter() - t
        _pin_every_thread(cpu)  # the kernel threads exist by now: each is pinned itself
        hog.start()
        os.sched_setaffinity(hog.pid, cpu)
        t0 = time.perf_counter()
        while eng.governor.n == 2 and time.perf_counter() - t0 < 20 and len(cache) < 4000:
            eng.step([(cache, [5])])
        assert eng.governor.n == 1, f"still {eng.governor.n} threads after {len(cache)} steps " \
                                    f"({eng.governor.trials} trials; a quiet step: {quiet * 1e3:.2f} ms)"
        assert eng.governor.trials == 1  # the early one
        m.close()
    finally:
        stop.set()
        if hog.pid is not None:
            hog.join(5)
        _pin_every_thread(saved)
        K.set_small_work(1 << 15)


def _cgroup(root, files: dict[str, str]):
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


@pytest.mark.parametrize("files,want", [
    ({"cpu.max": "200000 100000\n"}, 2),  # v2: docker --cpus=2
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores: rounded up
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu.max": "max 100000\n"}, None),  # v2, no quota
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),  # v1
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_the_cgroup_cpu_quota_is_read(tmp_path, files, want):
    from coli.engine import cpu_quota
    assert cpu_quota(_cgroup(tmp_path, files)) == want


def test_default_threads_is_no_more_than_the_quota(monkeypatch, tmp_path):
    import coli.engine as E
    monkeypatch.delenv("COLI_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(E, "cpu_quota", lambda: 1)
    assert E.default_threads() == 1
    monkeypatch.setattr(E, "cpu_quota", lambda: cpus + 8)  # a quota above the mask: the mask
    assert E.default_threads() == cpus
    monkeypatch.setattr(E, "cpu_quota", lambda: None)
    assert E.default_threads() == cpus
    monkeypatch.setenv("COLI_THREADS", "5")  # asked for: as asked
    assert E.default_threads() == 5
