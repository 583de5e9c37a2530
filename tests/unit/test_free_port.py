"""free_port: a port a launcher picks now for a child to listen on later must not be one the kernel can hand
out meanwhile (a CI run lost a learner to 'Address already in use' on its launcher-picked HTTP port)."""

import socket

from asyncrlhf.redis_server import ephemeral_ports, free_port


def test_picked_ports_lie_below_the_kernels_own_range_and_are_never_repeated():
    low, high = ephemeral_ports()
    assert low < high
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(10000 <= p < low for p in ports), ports


def test_a_picked_port_can_be_listened_on():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)


def test_a_port_held_by_someone_else_is_not_picked():
    held = []
    try:
        for _ in range(30):
            port = free_port()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", port))
            held.append(sock)
        taken = {s.getsockname()[1] for s in held}
        assert free_port() not in taken
    finally:
        for sock in held:
            sock.close()
