"""`ftctl store ...`: run a standalone store, and inspect a live job's keys.

Owns: the click group `store` with `serve` (an embedded `StoreServer` in the foreground, for
debugging and benchmarks), `get`, `set` and `ls` (through `StoreClient`). Keys are logical keys
(what a torch `TCPStore` user passes). The address comes from `--addr host:port`, else
$FTRUN_STORE_ADDR, else $MASTER_ADDR:$MASTER_PORT; the token from `--token-file`, else
$FTRUN_JOB_TOKEN. Also runnable as `python -m rendezvous.store.store_cli`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import click

from rendezvous.kv import StoreError
from rendezvous.store.auth import TokenError, resolve_token


def parse_addr(addr: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port); ValueError with a clear message."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"store address {addr!r}: expected host:port (e.g. 10.0.0.1:29500)")
    return host.strip("[]"), int(port)


def _default_addr() -> str | None:
    if os.environ.get("FTRUN_STORE_ADDR"):
        return os.environ["FTRUN_STORE_ADDR"]
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return None


def _token(token_file: str | None) -> str | None:
    try:
        return resolve_token(token_file)
    except TokenError as e:
        raise click.ClickException(str(e)) from None


def _client(addr: str | None, token_file: str | None, timeout: float):
    from rendezvous.store.client import StoreClient

    addr = addr or _default_addr()
    if not addr:
        raise click.ClickException(
            "no store address: pass --addr host:port (or set FTRUN_STORE_ADDR)"
        )
    try:
        host, port = parse_addr(addr)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    return StoreClient(host, port, token=_token(token_file), timeout=timeout)


_addr_opt = click.option(
    "--addr",
    default=None,
    metavar="HOST:PORT",
    help="Store address (default: $FTRUN_STORE_ADDR, then $MASTER_ADDR:$MASTER_PORT).",
)
_token_opt = click.option(
    "--token-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="File holding the job token (mode 0600); default: $FTRUN_JOB_TOKEN.",
)
_timeout_opt = click.option(
    "--timeout", default=10.0, show_default=True, type=float, help="Seconds to wait for the store."
)


@click.group("store", context_settings={"help_option_names": ["-h", "--help"]})
def store() -> None:
    """Run a standalone store, or read and write a live job's store keys."""


@store.command("serve")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    default=29500,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to listen on (0 = any free port).",
)
@click.option(
    "--accel/--no-accel",
    default=True,
    envvar="FTRUN_STORE_ACCEL",
    show_envvar=True,
    help="Use the C read path where it was built (--no-accel: the Python path only).",
)
@_token_opt
def serve(host: str, port: int, accel: bool, token_file: str | None) -> None:
    """Serve an embedded store in the foreground until SIGINT/SIGTERM."""
    from rendezvous.store.server import StoreServer

    token = _token(token_file)
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server = StoreServer(
                host=host,
                port=port,
                token=token,
                log=lambda m: click.echo(m, err=True),
                accel=accel,
            ).start()
        except (StoreError, ValueError) as e:  # ValueError: FTRUN_STORE_NICE
            raise click.ClickException(str(e)) from None
        with server:
            click.echo(
                f"ftrun store listening on {host}:{server.port} "
                f"(job token {'required' if token else 'not required'})",
            )
            sys.stdout.flush()
            while not stop.wait(1.0):
                pass
        click.echo("ftrun store stopped")
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@store.command("get")
@click.argument("key")
@_addr_opt
@_token_opt
@_timeout_opt
@click.option(
    "--wait",
    "wait_s",
    default=0.0,
    type=float,
    help="Wait up to this many seconds for the key to appear.",
)
def get(key: str, addr: str | None, token_file: str | None, timeout: float, wait_s: float) -> None:
    """Print the value of KEY."""
    with _client(addr, token_file, timeout) as c:
        try:
            v = c.get(key, wait_s) if wait_s > 0 else c.try_get(key)
        except StoreError as e:
            raise click.ClickException(str(e)) from None
    if v is None:
        raise click.ClickException(f"key {key!r} is not in the store at {c.address}")
    _echo_value(v)


@store.command("set")
@click.argument("key")
@click.argument("value")
@_addr_opt
@_token_opt
@_timeout_opt
def set_(key: str, value: str, addr: str | None, token_file: str | None, timeout: float) -> None:
    """Set KEY to VALUE (UTF-8)."""
    with _client(addr, token_file, timeout) as c:
        try:
            c.set(key, value.encode())
            c.ping()  # SET has no reply: make sure the store took it
        except StoreError as e:
            raise click.ClickException(str(e)) from None


@store.command("ls")
@click.argument("prefix", default="")
@_addr_opt
@_token_opt
@_timeout_opt
@click.option("--values", "show_values", is_flag=True, help="Also print (shortened) values.")
def ls(
    prefix: str, addr: str | None, token_file: str | None, timeout: float, show_values: bool
) -> None:
    """List the keys that start with PREFIX."""
    with _client(addr, token_file, timeout) as c:
        try:
            keys = c.keys(prefix)
            for k in keys:
                if show_values:
                    v = c.try_get(k)
                    click.echo(f"{k}\t{_short(v)}")
                else:
                    click.echo(k)
        except StoreError as e:
            raise click.ClickException(str(e)) from None


def _short(v: bytes | None, n: int = 80) -> str:
    if v is None:
        return "(deleted)"
    try:
        s = v.decode()
        if s.isprintable():
            return s if len(s) <= n else s[:n] + f"... ({len(v)} bytes)"
    except UnicodeDecodeError:
        pass
    return f"<{len(v)} bytes: {v[:24].hex()}{'...' if len(v) > 24 else ''}>"


def _echo_value(v: bytes) -> None:
    try:
        click.echo(v.decode())
    except UnicodeDecodeError:
        sys.stdout.buffer.write(v)
        sys.stdout.buffer.flush()


def main(argv: list[str] | None = None) -> None:
    try:
        store.main(
            args=sys.argv[1:] if argv is None else argv,
            prog_name="ftctl store",
            standalone_mode=False,
        )
    except click.ClickException as e:
        click.echo(f"ftctl store: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code or 2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        sys.exit(1)


if __name__ == "__main__":
    main()
