"""A real ``redis-server`` process per test (or per session), on a free 127.0.0.1 port."""

from __future__ import annotations

import shutil

import pytest

from kvfuse_testkit import LocalRedis as RedisServer

__all__ = ["RedisServer", "redis_server", "redis_server_session"]


def _start_server() -> RedisServer:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed: apt-get install -y redis-server")
    return RedisServer(exe).start()


@pytest.fixture
def redis_server():
    """A fresh redis-server for one test; always stopped afterwards."""
    server = _start_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server_session():
    """One redis-server shared by a whole session (do not stop it in a test)."""
    server = _start_server()
    try:
        yield server
    finally:
        server.stop()
