"""CompileCache: bounded, least recently used out first, one build per key under concurrent requests."""

import threading
import time

import pytest

from workbench.core.programs import CompileCache


def test_bound_and_lru_order():
    cache = CompileCache(maxsize=2)
    cache.get(("t", "a"), lambda: 1)
    cache.get(("t", "b"), lambda: 2)
    assert cache.get(("t", "a"), lambda: -1) == (1, False, 0.0)  # a hit moves "a" to the end
    cache.get(("t", "c"), lambda: 3)  # full: "b", the least recently used, goes
    assert cache.keys() == [("t", "a"), ("t", "c")] and len(cache) == 2
    assert ("t", "b") not in cache
    found = cache.get(("t", "b"), lambda: 22)
    assert found.value == 22 and found.compiled and found.seconds >= 0


def test_clear_one_user_or_all():
    cache = CompileCache(maxsize=4)
    for key in (("lab", 1), ("gen", 1), ("lab", 2)):
        cache.get(key, lambda: 0)
    cache.clear("lab")
    assert cache.keys() == [("gen", 1)]
    cache.clear()
    assert len(cache) == 0


def test_bad_maxsize():
    with pytest.raises(ValueError, match="maxsize must be a positive int"):
        CompileCache(maxsize=0)


def test_a_key_asked_by_many_threads_at_once_is_built_once():
    cache = CompileCache(maxsize=4)
    calls, started = [], threading.Event()

    def build():
        calls.append(threading.get_ident())
        started.set()
        time.sleep(0.2)  # the other threads arrive while this one builds
        return object()

    results = [None] * 8
    def ask(i):
        results[i] = cache.get(("t", "slow"), build)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(calls) == 1
    assert len({id(r.value) for r in results}) == 1
    assert sum(r.compiled for r in results) == 1
    # a waiter reports the time it waited; none waited 0 unless it arrived after the build
    assert all(r.seconds > 0.1 for r in results if r.compiled)


def test_another_key_is_served_while_one_builds():
    cache = CompileCache(maxsize=4)
    cache.get(("t", "ready"), lambda: "ready")
    release = threading.Event()
    thread = threading.Thread(target=cache.get, args=(("t", "slow"), lambda: release.wait(10)))
    thread.start()
    try:
        start = time.perf_counter()
        assert cache.get(("t", "ready"), lambda: "rebuilt").value == "ready"
        assert cache.get(("t", "other"), lambda: "other").compiled
        assert time.perf_counter() - start < 1  # the global lock is not held while "slow" builds
    finally:
        release.set()
        thread.join(10)


def test_a_failed_build_raises_to_its_caller_and_a_waiter_builds_for_itself():
    cache = CompileCache(maxsize=4)
    entered, release = threading.Event(), threading.Event()

    def failing():
        entered.set()
        release.wait(10)
        raise RuntimeError("compile failed")

    errors = []
    def first():
        try:
            cache.get(("t", "k"), failing)
        except RuntimeError as e:
            errors.append(e)

    thread = threading.Thread(target=first)
    thread.start()
    entered.wait(10)
    waiter = []
    second = threading.Thread(target=lambda: waiter.append(cache.get(("t", "k"), lambda: "ok")))
    second.start()
    release.set()
    thread.join(10)
    second.join(10)
    assert [str(e) for e in errors] == ["compile failed"]
    assert waiter[0].value == "ok" and waiter[0].compiled and ("t", "k") in cache
