"""What a process tree listens on: TCP listeners and bound UDP sockets, loopback or not."""

import os
import socket

from rlhf_testkit import listening_sockets


def test_tcp_listeners_and_bound_udp_sockets_are_seen_with_their_address():
    tcp, udp_local, udp_any, client = (socket.socket(socket.AF_INET, t) for t in (
        socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_DGRAM, socket.SOCK_DGRAM))  # fmt: skip
    try:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen()
        udp_local.bind(("127.0.0.1", 0))
        udp_any.bind(("0.0.0.0", 0))
        client.connect(("127.0.0.1", udp_local.getsockname()[1]))  # has a peer: takes nothing from others
        seen = {(s.protocol, s.port): s for s in listening_sockets(os.getpid())}
        assert seen[("tcp", tcp.getsockname()[1])].loopback
        assert seen[("udp", udp_local.getsockname()[1])].loopback
        assert not seen[("udp", udp_any.getsockname()[1])].loopback
        assert ("udp", client.getsockname()[1]) not in seen
    finally:
        for s in (tcp, udp_local, udp_any, client):
            s.close()
