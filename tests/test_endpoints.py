"""rendezvous.store.endpoints: the one parser of endpoint strings, and both of its callers."""

from __future__ import annotations

import pytest

from launcher.cli.ftrun import parse
from launcher.config import ConfigError, build_config
from rendezvous.store.endpoints import Endpoint, EndpointError, parse_endpoint, parse_endpoints

SCRIPT = __file__


@pytest.mark.parametrize(
    "text, want",
    [
        ("host", Endpoint("host", 99)),
        ("host:1234", Endpoint("host", 1234)),
        ("  10.0.0.1:5  ", Endpoint("10.0.0.1", 5)),
        ("[::1]", Endpoint("::1", 99)),
        ("[::1]:23", Endpoint("::1", 23)),
        ("[fe80::1%eth0]:7", Endpoint("fe80::1%eth0", 7)),
        ("http://h:5/", Endpoint("h", 5)),
        ("HTTPS://[::1]:6", Endpoint("::1", 6)),
        ("https://node-1.example_x", Endpoint("node-1.example_x", 99)),
        ("h:65535", Endpoint("h", 65535)),
    ],
)
def test_one_endpoint_forms(text: str, want: Endpoint) -> None:
    assert parse_endpoint(text, 99) == want


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "is empty"),
        ("http://", "is empty"),
        ("h:0", "port '0' is not a number in 1..65535"),
        ("h:65536", "port '65536'"),
        ("h:x", "port 'x'"),
        ("h:-1", "port '-1'"),
        ("::1", "write IPv6 addresses as [addr]:port"),
        ("[::1", "missing ']'"),
        ("[]:5", "empty IPv6 address"),
        ("[::1]x", "expected ':port' after ']'"),
        (":5", "missing host"),
        ("a b:5", "host 'a b' may only hold"),
        ("tcp://h:5", "scheme 'tcp' is not supported; use http:// or https:// or none"),
        ("a:1,b:2", "expected one host[:port] or [ipv6]:port, not a list"),
    ],
)
def test_one_endpoint_errors_name_the_value(text: str, needle: str) -> None:
    with pytest.raises(EndpointError) as e:
        parse_endpoint(text, 99, what="--flag")
    msg = str(e.value)
    assert needle in msg and msg.startswith("--flag") and "\n" not in msg
    assert isinstance(e.value, ValueError)


def test_port_zero_only_when_the_caller_allows_it() -> None:
    assert parse_endpoint("localhost:0", 1, min_port=0) == Endpoint("localhost", 0)
    with pytest.raises(EndpointError, match=r"1\.\.65535"):
        parse_endpoint("localhost:0", 1)


def test_lists_keep_order_skip_blanks_and_pass_endpoints_through() -> None:
    assert parse_endpoints("a, b:2,,[::1]:3,", 7) == [
        Endpoint("a", 7),
        Endpoint("b", 2),
        Endpoint("::1", 3),
    ]
    assert parse_endpoints(["a", Endpoint("z", 1), "http://c:4"], 7) == [
        Endpoint("a", 7),
        Endpoint("z", 1),
        Endpoint("c", 4),
    ]
    with pytest.raises(EndpointError, match="no etcd endpoint given"):
        parse_endpoints(" , ", 7, what="etcd endpoint")
    with pytest.raises(EndpointError, match="etcd endpoint 'b:x': port"):
        parse_endpoints("a,b:x", 7, what="etcd endpoint")


def test_target_brackets_ipv6() -> None:
    assert Endpoint("::1", 23).target == "[::1]:23" == str(Endpoint("::1", 23))
    assert Endpoint("h", 5).target == "h:5"


def test_etcd_backend_uses_the_same_parser() -> None:
    from rendezvous.store.etcd import (
        DEFAULT_PORT,
    )
    from rendezvous.store.etcd import (
        Endpoint as EtcdEndpoint,
    )
    from rendezvous.store.etcd import (
        parse_endpoints as etcd_parse,
    )

    eps = etcd_parse("http://a,[::1]:5")
    assert eps == [EtcdEndpoint("a", DEFAULT_PORT), EtcdEndpoint("::1", 5)]
    assert all(isinstance(e, EtcdEndpoint) for e in eps)
    with pytest.raises(EndpointError, match="scheme 'unix'"):
        etcd_parse("unix://sock")


def cfg(*args: str):
    return build_config(parse([*args, SCRIPT]), env={})


def test_config_embedded_endpoint_default_port_and_ipv6() -> None:
    c = cfg(
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "[::1]", "--nnodes", "2", "--node_rank", "1"
    )
    assert (c.store_host, c.store_port, c.master_addr_for_workers) == ("::1", 29400, "::1")
    c = cfg("--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0")  # torchrun --standalone's
    assert (c.store_host, c.store_port) == ("localhost", 0)


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--rdzv_backend", "c10d", "--rdzv_endpoint", "h:x", "--nnodes", "2"],
            "--rdzv-endpoint 'h:x': port 'x' is not a number in 0..65535",
        ),
        (["--rdzv_backend", "c10d", "--rdzv_endpoint", "a:1,b:2", "--nnodes", "2"], "not a list"),
        (["--rdzv_backend", "etcd", "--rdzv_endpoint", "a:1,b:x"], "--rdzv-endpoint 'b:x': port"),
        (["--rdzv_backend", "etcd", "--rdzv_endpoint", "a:0"], "1..65535"),
    ],
)
def test_config_reports_bad_endpoints_at_start(args: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        cfg(*args)
    assert needle in str(e.value)
