"""The job's TCPStore, as emulated ranks reach it: torch's real server, and a client of
its wire protocol in plain Python, so that a process hosting hundreds of emulated ranks
needs no torch (importing torch costs about 1.7 CPU-seconds and 140 MB of private memory
per process here: ``docs/scale.md``, "Emulated ranks").

The protocol is the one torch 2.13's ``TCPStoreBackend.hpp`` declares (``QueryType``: one
byte per command; keys and values as a little-endian 64-bit length and the bytes; a
``VALIDATE`` message with the store's magic number first). A user key ``k`` travels as
``/k``, as torch's ``TCPStore`` prefixes it; the workers' registration key ``init/``
travels bare. ``tests/train/test_emulate.py`` checks it against torch's own client.
"""

from __future__ import annotations

import os
import socket
import struct
import time

VALIDATE, SET, GET, ADD, WAIT, MULTI_GET, PING = 0, 1, 3, 4, 6, 10, 13  # QueryType
MAGIC = 0x3C85F7CE  # TCPStore's validation number
INIT_KEY = "init/"  # each worker adds 1 here as it joins (TCPStore's waitForWorkers)
RETRY_S = 0.1  # between connection attempts while the server is not up yet
TIMEOUT_S = 600.0  # to reach the server, as the job's rendezvous (init_distributed)


def start_server(host: str, port: int, world_size: int, timeout_s: float) -> object:
    """torch's TCPStore server (libuv), as the job's rank 0 starts it; the only torch in an
    emulated job."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        host, port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip


def packed_key(key: str) -> bytes:
    data = key.encode()
    return struct.pack("<Q", len(data)) + data


class StoreClient:
    """One rank's connection to the job's TCPStore (set, get, add, multi_get)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self.sock = connect(host, port, timeout_s)
        self.sock.sendall(struct.pack("<BI", VALIDATE, MAGIC))
        nonce = os.getpid() & 0xFFFFFFFF
        self.sock.sendall(struct.pack("<BI", PING, nonce))
        if self.receive(4) != struct.pack("<I", nonce):
            raise ConnectionError(f"TCPStore at {host}:{port}: wrong answer to a ping")

    def receive(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("TCPStore: the server closed the connection")
            data += chunk
        return data

    def receive_value(self) -> bytes:
        return self.receive(struct.unpack("<Q", self.receive(8))[0])

    def set(self, key: str, value: bytes) -> None:
        self.sock.sendall(
            bytes([SET]) + packed_key("/" + key) + struct.pack("<Q", len(value)) + value
        )

    def add(self, key: str, amount: int, *, bare: bool = False) -> int:
        self.sock.sendall(
            bytes([ADD]) + packed_key(key if bare else "/" + key) + struct.pack("<q", amount)
        )
        return struct.unpack("<q", self.receive(8))[0]

    def wait(self, keys: list[str]) -> None:
        """Until every key is set (the server answers when they are)."""
        names = b"".join(packed_key("/" + k) for k in keys)
        self.sock.sendall(bytes([WAIT]) + struct.pack("<Q", len(keys)) + names)
        self.receive(1)

    def get(self, key: str) -> bytes:
        self.wait([key])
        self.sock.sendall(bytes([GET]) + packed_key("/" + key))
        return self.receive_value()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        names = b"".join(packed_key("/" + k) for k in keys)
        self.sock.sendall(bytes([MULTI_GET]) + struct.pack("<Q", len(keys)) + names)
        return [self.receive_value() for _ in keys]

    def barrier(self, name: str, world_size: int) -> None:
        """Every rank arrives at ``name`` before any leaves (the last one to arrive says so)."""
        if self.add(f"{name}/arrived", 1) == world_size:
            self.set(f"{name}/done", b"1")
        self.get(f"{name}/done")

    def close(self) -> None:
        self.sock.close()


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A connection to the server, retried until ``timeout_s`` (it may not be up yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(RETRY_S)
            continue
        sock.settimeout(None)  # a wait may last as long as a hang: the watchdog decides
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
