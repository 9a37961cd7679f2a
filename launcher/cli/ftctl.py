"""`ftctl`: operate a live ftrun job (store, injection, pause/resume, migrate, status, report).

Owns: the click group and its job-level subcommands. Store subcommands (`ftctl store serve|get|
set|ls`) come from `rendezvous.store.store_cli`; fault injection (`ftctl inject`) from
`launcher.cli.inject`; `ftctl pause`/`ftctl resume` from `launcher.cli.pause`; `ftctl migrate`
(a hot switch) from `launcher.cli.migrate`; `ftctl status` from `launcher.observe.status`;
`ftctl report` from `launcher.observe.report`.
A store or token error from any subcommand ends as one line and exit 1.
"""

from __future__ import annotations

import sys

import click

from rendezvous.kv import StoreError
from rendezvous.store.auth import TokenError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Inspect and operate a running ftrun job."""


def _register() -> None:
    try:
        from rendezvous.store.store_cli import store
    except ImportError:  # pragma: no cover - partial checkout
        store = None
    if store is not None:
        cli.add_command(store, "store")
    try:
        from launcher.cli.inject import inject
    except ImportError:  # pragma: no cover
        inject = None
    if inject is not None:
        cli.add_command(inject, "inject")
    from launcher.cli.pause import pause, resume

    cli.add_command(pause, "pause")
    cli.add_command(resume, "resume")
    from launcher.cli.migrate import migrate

    cli.add_command(migrate, "migrate")
    from launcher.observe.report import report
    from launcher.observe.status import status

    cli.add_command(status, "status")
    cli.add_command(report, "report")


_register()


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(
            args=sys.argv[1:] if argv is None else argv, prog_name="ftctl", standalone_mode=False
        )
    except click.ClickException as e:
        click.echo(f"ftctl: error: {e.format_message()}", err=True)
        sys.exit(e.exit_code if e.exit_code else 2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.Abort:
        sys.exit(1)
    except (
        StoreError,
        TokenError,
    ) as e:  # unreachable store, refused token: one line, no traceback
        click.echo(f"ftctl: error: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
