"""The progress bar of long commands and benchmarks (app/ops/progress.py)."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console

from app.ops.progress import steps


def test_each_step_prints_its_line_and_names_itself_beside_the_bar():
    console = Console(width=100, record=True, force_terminal=False)
    with steps(console, "searches", 3) as step:
        step("seed 0 PDD", "  seed 0 PDD: 9.50 RPS in SLA")
        step("seed 0 intra-DC")
        step("seed 1 PDD", "  seed 1 PDD: 9.10 RPS in SLA")
    text = console.export_text()
    assert "  seed 0 PDD: 9.50 RPS in SLA" in text and "  seed 1 PDD: 9.10 RPS in SLA" in text
    assert "seed 0 intra-DC" not in text.replace("searches: seed 0 intra-DC", "")  # a name without a line only labels the bar
    assert "searches: seed 1 PDD" in text and "3/3" in text and "left" in text


def test_no_step_shows_no_bar():
    console = Console(width=100, record=True)
    with steps(console, "simulations", 0) as step:
        step("nothing", "a line still prints")
    assert console.export_text() == "a line still prints\n"


def test_the_split_search_never_searches_more_splits_than_its_bar_counts(monkeypatch):
    """bench/paper_table.py's bar over its ternary search: `most_splits` bounds the searches for any single-peaked curve."""
    import io
    import random

    import bench.paper_table as paper_table

    monkeypatch.setattr(paper_table, "console", Console(file=io.StringIO()))
    monkeypatch.setattr(paper_table, "fleet", str)
    monkeypatch.setattr(paper_table, "cost_per_hour", lambda c: 0.0)
    rng = random.Random(3)
    for n in [*range(1, 40), 97, 150]:
        peak = rng.randrange(n)
        searched: list[int] = []

        class Traffic:
            def search(self, split, seed, lo, searched=searched, peak=peak):
                searched.append(split)
                return SimpleNamespace(rps=-abs(split - peak))

        best, _ = paper_table.best_split("x", range(n), lambda p: p, Traffic())
        assert best == peak and len(searched) <= paper_table.most_splits(n), (n, peak, len(searched))
