"""The agent swarm that keeps PDD tuned: one LangGraph graph run per tick.

observe (app/telemetry/snapshot.py) -> diagnose (situations.py, diagnose.py, figures.py) ->
specialists (specialists/: routing, handoff, capacity, clerk; handoffs in
router.py) -> guard (guard.py) -> [approve] -> act (actuate.py) -> verify
(verify.py) -> record (memory.py, entries.py); nodes.py and tick.py, wired in graph.py, run live by
runner.py and cli.py, and against the digital twin by twin.py.
"""
