"""`ftrun`: the command line, flag for flag the same as torchrun's, plus ftrun's own flags.

Owns: the click command, torchrun-compatible parsing details (both spellings, `PET_*`
environment fallbacks, unambiguous abbreviations, everything after the script passed through
untouched, exit 2 with one line on a parse error) and the hand-off to the agent. Validation
lives in `launcher.config`; supervision in `launcher.agent.agent`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import click

from launcher.config import ConfigError, build_config


@dataclass(frozen=True)
class Opt:
    """One torchrun-style option: all its spellings, where it lands, its type and default."""

    names: tuple[str, ...]
    dest: str
    default: Any = None
    type: Any = str
    flag: bool = False
    choices: tuple[str, ...] | None = None
    env: bool = True  # reads PET_<DEST>
    help: str = ""


def _both(name: str) -> tuple[str, ...]:
    dash = "--" + name.replace("_", "-")
    under = "--" + name.replace("-", "_")
    return (dash, under) if dash != under else (dash,)


TORCHRUN_OPTIONS: tuple[Opt, ...] = (
    Opt(("--nnodes",), "nnodes", "1:1", help="Number of nodes, N or MIN:MAX."),
    Opt(
        _both("nproc_per_node"),
        "nproc_per_node",
        "1",
        help="Workers per node: an integer or cpu, gpu, xpu, npu, auto.",
    ),
    Opt(
        _both("rdzv_backend"),
        "rdzv_backend",
        "static",
        help="static, c10d, parallel (embedded store) or etcd, etcd-v3, etcd-v2.",
    ),
    Opt(
        _both("rdzv_endpoint"),
        "rdzv_endpoint",
        "",
        help="Store endpoint host[:port] (etcd: comma list).",
    ),
    Opt(_both("rdzv_id"), "rdzv_id", "none", help="Job id shared by all nodes."),
    Opt(
        _both("rdzv_conf"),
        "rdzv_conf",
        "",
        help="key=value,... (join_timeout, last_call_timeout, "
        "proxy, token_file, is_host, cacert, cert, key, user, password, protocol).",
    ),
    Opt(
        ("--standalone",),
        "standalone",
        False,
        flag=True,
        help="Single node, local store on a free port.",
    ),
    Opt(
        _both("max_restarts"),
        "max_restarts",
        0,
        int,
        help="Recovery rounds allowed for the WHOLE job (torchrun: per agent).",
    ),
    Opt(
        _both("monitor_interval"),
        "monitor_interval",
        0.1,
        float,
        help="Seconds between health checks (exits are detected at once regardless).",
    ),
    Opt(_both("start_method"), "start_method", "spawn", choices=("spawn", "fork", "forkserver")),
    Opt(_both("event_log_handler"), "event_log_handler", "null"),
    Opt(("--role",), "role", "default", help="Role name (log prefix, ROLE_NAME)."),
    Opt(
        ("-m", "--module"),
        "module",
        False,
        flag=True,
        help="Run the script as a module (python -m).",
    ),
    Opt(_both("no_python"), "no_python", False, flag=True, help="Execute the script directly."),
    Opt(_both("run_path"), "run_path", False, flag=True),
    Opt(
        _both("log_dir"),
        "log_dir",
        None,
        help="Base directory for per-attempt logs and events.jsonl.",
    ),
    Opt(
        ("-r", "--redirects"),
        "redirects",
        "0",
        help="0-3 or 0:1,1:2 (1 stdout, 2 stderr, 3 both) to files.",
    ),
    Opt(
        ("-t", "--tee"), "tee", "0", help="Like --redirects, and also to the console with a prefix."
    ),
    Opt(
        _both("local_ranks_filter"),
        "local_ranks_filter",
        "",
        help="Local ranks shown on the console.",
    ),
    Opt(_both("duplicate_stdout_filters"), "duplicate_stdout_filters", ()),
    Opt(_both("duplicate_stderr_filters"), "duplicate_stderr_filters", ()),
    Opt(_both("node_rank"), "node_rank", 0, int, help="This node's rank (static rendezvous)."),
    Opt(_both("master_addr"), "master_addr", "127.0.0.1", help="Address of the node-0 store."),
    Opt(
        _both("master_port"),
        "master_port",
        None,
        int,
        help="Port of the node-0 store (default 29500).",
    ),
    Opt(_both("local_addr"), "local_addr", None),
    Opt(_both("logs_specs"), "logs_specs", None, env=False),
    Opt(
        _both("numa_binding"),
        "numa_binding",
        None,
        choices=("node", "socket", "exclusive", "core-complex"),
        env=False,
    ),
    Opt(
        _both("signals_to_handle"),
        "signals_to_handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="Signals forwarded to the workers before shutdown.",
    ),
    Opt(
        _both("shutdown_timeout"),
        "shutdown_timeout",
        None,
        int,
        help="Seconds between SIGTERM and SIGKILL (default $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).",
    ),
    Opt(_both("virtual_local_rank"), "virtual_local_rank", False, flag=True),
    # torch 2.14+ flags, accepted on every torch version
    Opt(
        _both("log_line_prefix_template"),
        "log_line_prefix_template",
        None,
        help="Prefix of worker lines: ${role_name} ${local_rank} ${rank} ${hostname}.",
    ),
    Opt(
        _both("print_completion"),
        "print_completion",
        None,
        choices=("bash", "zsh", "fish"),
        env=False,
        help="Print a shell completion script and exit.",
    ),
)

FTRUN_OPTIONS: tuple[Opt, ...] = (
    Opt(
        _both("recover_strategy"),
        "recover_strategy",
        None,
        help="Strategy chain, cheapest first (default retry,recover-in-place,restart-all,exit).",
    ),
    Opt(
        _both("hang_timeout"),
        "hang_timeout",
        "auto",
        help="Seconds without progress before a worker counts as hung: auto (adapts to the step "
        "times; 600 s for unmodified scripts), SECONDS, or 0 (off).",
    ),
    Opt(
        _both("warm_spares"),
        "warm_spares",
        None,
        help="Warm spare processes per node (torch imported, ready to replace a rank): 0-8, "
        "default $FTRUN_WARM_SPARES or 2 (FTRUN_WARM_SPARE=0: none).",
    ),
    Opt(
        ("--enable_tiered_parallel_tcpstore", "--enable-tiered-parallel-tcpstore"),
        "enable_tiered_parallel_tcpstore",
        None,
        help="torch_npu_run's flag: true turns the store proxies on.",
    ),
)

ALL_OPTIONS = TORCHRUN_OPTIONS + FTRUN_OPTIONS


def _env_name(dest: str) -> str:
    return "PET_" + dest.upper()


def _comma_list(value: Any) -> list[str]:
    """torchrun's duplicate-filter syntax: comma separated, `,,` escapes a comma."""
    if value in (None, "", ()):
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    parts = str(value).replace(",,", "\0").split(",")
    return [p.replace("\0", ",") for p in parts if p]


class TorchrunCommand(click.Command):
    """A click command that also accepts argparse-style unambiguous long-option prefixes and
    stops option parsing at the training script."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, expand_abbreviations(args))


def expand_abbreviations(args: list[str]) -> list[str]:
    names: dict[str, Opt] = {n: o for o in ALL_OPTIONS for n in o.names}
    names["--help"] = Opt(("--help",), "help", flag=True)
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--" or not a.startswith("-") or a == "-":
            out.extend(args[i:])
            break
        name, eq, val = a.partition("=")
        opt = names.get(name)
        if opt is None and name.startswith("--"):
            matches = sorted(n for n in names if n.startswith(name))
            if len(matches) == 1:
                name = matches[0]
                opt = names[name]
            elif len(matches) > 1:
                raise click.UsageError(f"ambiguous option: {name} could match {', '.join(matches)}")
        out.append(name + eq + val)
        if opt is not None and not opt.flag and not eq and i + 1 < len(args):
            out.append(args[i + 1])
            i += 1
        i += 1
    return out


def _make_command() -> click.Command:
    params: list[click.Parameter] = []
    for o in ALL_OPTIONS:
        envvar = _env_name(o.dest) if o.env else None
        if o.flag:
            params.append(
                click.Option(
                    [*o.names, o.dest], is_flag=True, default=o.default, envvar=envvar, help=o.help
                )
            )
        else:
            typ = click.Choice(o.choices) if o.choices else o.type
            default = o.default if not isinstance(o.default, tuple) else None
            params.append(
                click.Option(
                    [*o.names, o.dest],
                    type=typ,
                    default=default,
                    envvar=envvar,
                    help=o.help,
                    show_default=default not in (None, ""),
                )
            )
    params.append(click.Argument(["training_script"], required=False))
    params.append(click.Argument(["training_script_args"], nargs=-1, type=click.UNPROCESSED))
    return TorchrunCommand(
        "ftrun",
        params=params,
        callback=lambda **kw: kw,
        help="Launch a distributed training job like torchrun, and keep it running through faults.",
        context_settings={
            "allow_interspersed_args": False,
            "help_option_names": ["-h", "--help"],
            "max_content_width": 100,
        },
        add_help_option=True,
    )


COMMAND = _make_command()


def parse(argv: list[str]) -> dict[str, Any]:
    """Parse argv into a dict keyed by torchrun dest names (raises click.UsageError)."""
    result = COMMAND.main(args=list(argv), prog_name="ftrun", standalone_mode=False)
    if not isinstance(result, dict):  # --help printed
        raise SystemExit(0)
    result["duplicate_stdout_filters"] = _comma_list(result.get("duplicate_stdout_filters"))
    result["duplicate_stderr_filters"] = _comma_list(result.get("duplicate_stderr_filters"))
    return result


def _print_completion(shell: str) -> None:
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None
    comp = cls(COMMAND, {}, "ftrun", "_FTRUN_COMPLETE")
    click.echo(comp.source())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        raw = parse(argv)
    except click.exceptions.Exit as e:
        return int(e.exit_code or 0)
    except click.ClickException as e:
        click.echo(f"ftrun: error: {e.format_message()}", err=True)
        sys.exit(2)
    except SystemExit as e:
        return int(e.code or 0)
    if raw.get("print_completion"):
        _print_completion(raw["print_completion"])
        return 0
    try:
        cfg = build_config(raw)
    except ConfigError as e:
        click.echo(f"ftrun: error: {e}", err=True)
        sys.exit(2)
    from launcher.agent.agent import run_agent  # imported late: keeps `ftrun --help` fast

    code = run_agent(cfg)
    _exit_within(code, EXIT_GRACE_S)
    sys.exit(code)


EXIT_GRACE_S = 10.0  # the interpreter's own exit (joining threads, atexit) may take this long
EXIT_LAST_RESORT_S = 5.0  # past the grace: a hang in the interpreter's finalization ends here


def _exit_within(code: int, grace: float, last_resort: float = EXIT_LAST_RESORT_S) -> None:
    """Everything the agent started is stopped when run_agent returns; if the interpreter's
    exit still hangs (a library thread that is not a daemon, an atexit handler), leave after
    `grace` seconds with the same code, naming the threads still running and printing their
    stacks; a hang in the interpreter's finalization ends `last_resort` s later (exit code 1,
    stacks printed by faulthandler). See `launcher.agent.exit_guard`."""
    from launcher.agent.exit_guard import ExitGuard

    ExitGuard(code, grace, "exit", last_resort)


if __name__ == "__main__":  # pragma: no cover
    main()
