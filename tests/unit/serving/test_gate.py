import threading

import pytest

from asyncrlhf.serving.gate import BackendGate, GateBusy

pytestmark = pytest.mark.unit
WAIT_S = 10


def _wait_until(condition, timeout_s: float = WAIT_S) -> bool:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return condition()


def test_swap_waits_for_the_batch_in_progress():
    gate, order = BackendGate(), []
    in_batch, release = threading.Event(), threading.Event()

    def batch():
        with gate.generating():
            in_batch.set()
            release.wait(WAIT_S)
            order.append("batch")

    def swap():
        with gate.swapping():
            order.append("swap")

    threads = [threading.Thread(target=batch)]
    threads[0].start()
    assert in_batch.wait(WAIT_S)
    threads.append(threading.Thread(target=swap))
    threads[1].start()
    assert _wait_until(lambda: gate.swaps_waiting == 1)
    assert order == []  # the swap is parked while the batch holds the backend
    release.set()
    for t in threads:
        t.join(WAIT_S)
    assert order == ["batch", "swap"]


def test_a_waiting_swap_goes_before_the_next_batch():
    gate, order = BackendGate(), []
    in_first, release = threading.Event(), threading.Event()

    def first_batch():
        with gate.generating():
            in_first.set()
            release.wait(WAIT_S)
            order.append("batch 1")

    def swap():
        with gate.swapping():
            order.append("swap")

    def second_batch():
        with gate.generating():
            order.append("batch 2")

    t1 = threading.Thread(target=first_batch)
    t1.start()
    assert in_first.wait(WAIT_S)
    t2 = threading.Thread(target=swap)
    t2.start()
    assert _wait_until(lambda: gate.swaps_waiting == 1)
    t3 = threading.Thread(target=second_batch)
    t3.start()
    release.set()
    for t in (t1, t2, t3):
        t.join(WAIT_S)
    assert order == ["batch 1", "swap", "batch 2"]


def _queue(gate, holder_kind, waiters):
    """Hold the gate as `holder_kind`, park `waiters` (kinds, in this order) behind it, release; the order in
    which the waiters then got the backend."""
    order, held, release = [], threading.Event(), threading.Event()

    def hold():
        with gate.generating(holder_kind):
            held.set()
            release.wait(WAIT_S)

    def wait_turn(kind):
        with gate.generating(kind):
            order.append(kind)

    threads = [threading.Thread(target=hold)]
    threads[0].start()
    assert held.wait(WAIT_S)
    for kind in waiters:
        before = gate.waiting(kind)
        threads.append(threading.Thread(target=wait_turn, args=(kind,)))
        threads[-1].start()
        assert _wait_until(lambda k=kind, b=before: gate.waiting(k) == b + 1)
    release.set()
    for t in threads:
        t.join(WAIT_S)
    return order


def test_a_flood_of_api_requests_lets_the_training_loop_go_every_other_turn():
    order = _queue(BackendGate(), "api", ["api"] * 5 + ["loop"])
    assert order[0] == "loop"  # the loop waited behind an API batch: it goes before the five queued ones
    assert order.count("api") == 5


def test_a_busy_training_loop_still_lets_an_api_batch_through():
    order = _queue(BackendGate(), "loop", ["loop", "api"])
    assert order == ["api", "loop"]


def test_too_many_waiting_api_batches_are_refused():
    gate = BackendGate(max_api_waiting=2)
    held, release = threading.Event(), threading.Event()

    def hold():
        with gate.generating("loop"):
            held.set()
            release.wait(WAIT_S)

    def api():
        with gate.generating("api"):
            pass

    threads = [threading.Thread(target=hold)]
    threads[0].start()
    assert held.wait(WAIT_S)
    for _ in range(2):
        threads.append(threading.Thread(target=api))
        threads[-1].start()
    assert _wait_until(lambda: gate.waiting("api") == 2)
    with pytest.raises(GateBusy, match="2 API requests already wait"), gate.generating("api"):
        pass
    assert gate.waiting("loop") == 0  # the loop never queues behind the limit
    release.set()
    for t in threads:
        t.join(WAIT_S)
    assert gate.waiting("api") == 0
