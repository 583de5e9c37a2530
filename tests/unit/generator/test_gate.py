import threading

import pytest

from services.generator.gate import BackendGate

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
