"""Job-token auth: token sources, and the server refusing/accepting real clients."""

from __future__ import annotations

import os

import pytest
from helpers_store import run_torch, run_torch_ops

from rendezvous.kv import StoreAuthError, StoreError
from rendezvous.store.auth import (
    TOKEN_ENV,
    TokenError,
    generate_token,
    load_token_file,
    resolve_token,
    token_matches,
    write_token_file,
)
from rendezvous.store.client import StoreClient
from rendezvous.store.server import StoreServer

TOKEN = "s3cret-token"


def test_token_file_must_be_private(tmp_path) -> None:
    p = write_token_file(tmp_path / "tok", TOKEN)
    assert os.stat(p).st_mode & 0o777 == 0o600
    assert load_token_file(p) == TOKEN
    os.chmod(p, 0o644)
    with pytest.raises(TokenError, match="mode 0644: other users can access it; run `chmod 600"):
        load_token_file(p)
    with pytest.raises(TokenError, match="does not exist"):
        load_token_file(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    os.chmod(empty, 0o600)
    with pytest.raises(TokenError, match="non-empty"):
        load_token_file(empty)


def test_token_sources() -> None:
    a, b = generate_token(), generate_token()
    assert a != b and len(a) == 64
    assert resolve_token(None, {TOKEN_ENV: "abc"}) == "abc"
    assert resolve_token(None, {}) is None
    assert token_matches("abc", b"abc") and not token_matches("abc", b"abd")


@pytest.fixture
def server():
    logs: list[str] = []
    s = StoreServer(host="127.0.0.1", token=TOKEN, log=logs.append)
    s.logs = logs
    with s:
        yield s


def test_store_client_with_token_is_accepted(server: StoreServer) -> None:
    c = StoreClient("127.0.0.1", server.port, token=TOKEN, timeout=5)
    c.set("a", b"1")
    assert c.get("a", 1) == b"1" and c.keys() == ["a"]  # the auth key is never stored
    assert server.logs == []


def test_wrong_or_missing_token_is_refused(server: StoreServer) -> None:
    with pytest.raises(StoreAuthError, match="refused the job token"):
        StoreClient("127.0.0.1", server.port, token="wrong", timeout=5).set("a", b"1")
    assert "wrong job token" in server.logs[-1] and "127.0.0.1:" in server.logs[-1]
    with pytest.raises(StoreError, match="closed the connection \\(no job token given\\?\\)"):
        StoreClient("127.0.0.1", server.port, timeout=5).add("a", 1)
    assert server.logs[-1].startswith("store closed 127.0.0.1:")
    assert server.logs[-1].endswith("unauthenticated ADD refused (job token required)")
    assert len(server.logs) == 2
    assert server.kv.keys() == []


def test_torch_client_authenticates_with_a_set(server: StoreServer) -> None:
    r = run_torch_ops("127.0.0.1", server.port, token=TOKEN)
    assert "ALL-OPS-OK" in r.stdout, r.stdout + r.stderr[-3000:]
    refused = run_torch(
        "import sys, torch.distributed as d; from datetime import timedelta\n"
        "c = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False,"
        " timeout=timedelta(seconds=3))\n"
        "try:\n    c.set('x', b'1'); c.get('x')\nexcept Exception as e:\n"
        "    print('REFUSED', type(e).__name__)\n",
        server.port,
    )
    assert "REFUSED" in refused.stdout, refused.stderr[-2000:]
    assert "unauthenticated SET refused" in server.logs[-1]


def test_server_without_token_ignores_a_presented_one() -> None:
    with StoreServer(host="127.0.0.1") as s:
        c = StoreClient("127.0.0.1", s.port, token="anything", timeout=5)
        c.set("a", b"1")
        assert c.keys() == ["a"]
