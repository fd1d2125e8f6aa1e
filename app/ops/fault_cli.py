"""`pdd fault ...`: inject app/ops/faults.py's faults into a running app from the shell,
for drills: kill a role's replica, restart the conductor, cut, stall or slow a link,
expire prefill's KV leases. Each says what it did; `pdd status` shows the effect."""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import Any

import typer
from rich.console import Console

console = Console()
fault_cli = typer.Typer(help="Inject faults into a running app (drills; app/ops/faults.py).", no_args_is_help=True)

AppOption = typer.Option("pdd", "--app-name", help="Serve application name")
AddressOption = typer.Option(None, "--address", help="Ray cluster address (default: the one `pdd run` started here)")
Direction = typer.Argument(..., help="A link direction, e.g. dc-a->dc-b (quote it in a shell)")


class Target(str, Enum):
    prefill = "prefill"
    relay_decode = "relay_decode"
    main_decode = "main_decode"
    conductor = "conductor"


def _inject(app_name: str, address: str | None, fault: Callable[[Any], str]) -> None:
    """Connect, run `fault` on a Faults of the app, print what it says; a failure is one red line."""
    from app.ops.cluster import connected

    serve_logger = logging.getLogger("ray.serve")
    was_disabled, serve_logger.disabled = serve_logger.disabled, True  # its handles' chatter, not ours (Serve resets its level)
    try:
        with connected(address):
            from app.ops.faults import Faults  # imports Ray: only once connected() has set its auth mode

            said = fault(Faults(app_name))
    except Exception as exc:  # noqa: BLE001 - Ray wraps the cause (a replica's ValueError) in its own type
        cause = getattr(exc, "cause", None) or exc
        console.print(f"[red]{type(cause).__name__}: {cause}[/red]")
        raise typer.Exit(1) from None
    finally:
        serve_logger.disabled = was_disabled
    console.print(said)


@fault_cli.command("kill")
def kill(
    target: Target = typer.Argument(..., help="Whose replica (one at random when there are several)"), app_name: str = AppOption, address: str = AddressOption
) -> None:
    """Kill one replica as a crash would; Serve starts another."""
    from app.config import RoleName

    def fault(f) -> str:
        killed = f.kill_replica("Conductor") if target is Target.conductor else f.kill_role(RoleName(target.value))
        return f"killed {killed}; Serve starts another"

    _inject(app_name, address, fault)


@fault_cli.command("restart-conductor")
def restart_conductor(
    forget_index: bool = typer.Option(False, help="The next conductor starts from an empty prefix index, not the saved one"),
    app_name: str = AppOption,
    address: str = AddressOption,
) -> None:
    """Kill the conductor; the next one starts from the prefix index the last one saved."""

    def fault(f) -> str:
        killed = f.restart_conductor(forget_index)
        return f"killed {killed}; Serve starts another, from {'an empty' if forget_index else 'the saved'} prefix index"

    _inject(app_name, address, fault)


@fault_cli.command("cut")
def cut(
    direction: str = Direction,
    seconds: float = typer.Option(None, min=0, help="Restore after this long (default: at `pdd fault restore`)"),
    app_name: str = AppOption,
    address: str = AddressOption,
) -> None:
    """Sever a link: transfers on it fail, and the conductor routes around it."""

    def fault(f) -> str:
        f.cut_link(direction, seconds)
        return f"{direction} cut " + (f"for {seconds:g} s" if seconds is not None else "until `pdd fault restore`")

    _inject(app_name, address, fault)


@fault_cli.command("restore")
def restore(direction: str = Direction, app_name: str = AppOption, address: str = AddressOption) -> None:
    """Undo a cut, stall or slowdown of a link."""

    def fault(f) -> str:
        f.restore_link(direction)
        return f"{direction} restored to its configured figures"

    _inject(app_name, address, fault)


@fault_cli.command("stall")
def stall(
    direction: str = Direction,
    seconds: float = typer.Argument(..., min=0, help="How long transfers on it pause"),
    app_name: str = AppOption,
    address: str = AddressOption,
) -> None:
    """Pause every transfer on a link (it stays up: the transfer timeout bounds the wait)."""

    def fault(f) -> str:
        f.stall_link(direction, seconds)
        return f"{direction} stalled for {seconds:g} s"

    _inject(app_name, address, fault)


@fault_cli.command("slow")
def slow(
    direction: str = Direction,
    bandwidth_mbps: float = typer.Option(None, min=0.001, help="Its bandwidth, Mbit/s"),
    rtt_ms: float = typer.Option(None, min=0, help="Its round-trip time, ms"),
    app_name: str = AppOption,
    address: str = AddressOption,
) -> None:
    """Degrade a link until `pdd fault restore`; routing still plans with the configured figures."""
    if bandwidth_mbps is None and rtt_ms is None:
        console.print("[red]slow needs --bandwidth-mbps and/or --rtt-ms[/red]")
        raise typer.Exit(2)

    def fault(f) -> str:
        f.degrade_link(direction, bandwidth_mbps=bandwidth_mbps, rtt_ms=rtt_ms)
        figures = ([f"{bandwidth_mbps:g} Mbit/s"] if bandwidth_mbps is not None else []) + ([f"RTT {rtt_ms:g} ms"] if rtt_ms is not None else [])
        return f"{direction} slowed to {', '.join(figures)} until `pdd fault restore`"

    _inject(app_name, address, fault)


@fault_cli.command("expire-leases")
def expire_leases(app_name: str = AppOption, address: str = AddressOption) -> None:
    """Release every prefill replica's KV leases now: decoders that were to pull them recompute."""
    _inject(app_name, address, lambda f: f"{f.expire_leases()} KV leases released")
