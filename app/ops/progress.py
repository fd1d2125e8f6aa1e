"""A progress bar with time left, for long commands and benchmarks: each step named as it ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

#: `step(name, line=None)`: one step ended; `name` shows beside the bar, `line` (if any) is printed above it.
Step = Callable[..., None]


@contextmanager
def steps(console: Console, what: str, total: int) -> Iterator[Step]:
    """A bar over `total` steps, with elapsed time and time left (none for no step)."""
    if total <= 0:
        yield lambda name, line=None: console.print(line) if line else None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(what, total=total)

        def step(name: str, line: str | None = None) -> None:
            if line:
                bar.console.print(line)
            label = f"{what}: {name}"
            room = max(20, console.width // 2)  # the bar, counts and times keep the rest of the line
            bar.update(task, advance=1, description=label if len(label) <= room else label[: room - 1] + "…")

        yield step
