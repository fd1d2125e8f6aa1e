"""Runbook clerk: what needs a person rather than a knob.

Situations only a person can fix (a KV lease leak is a bug; a crashing
replica needs its logs read) become notices, and so does any SLO situation no
other specialist could act on (its knob at a bound, or held back so as not to
overload the relay). A notice changes nothing in the cluster; it files a
runbook action entry pointing at runbooks/<situation>.md.
"""

from __future__ import annotations

from agents.knobs import notice_target
from agents.proposal import Proposal
from agents.specialists.base import View

NAME = "clerk"


def propose(view: View) -> list[Proposal]:
    handled = {p.situation_key for p in view.proposals}
    out = []
    for s in view.situations:
        mine = NAME in s.specialists
        stranded = s.severity > 0 and s.key not in handled
        if not (mine or stranded):
            continue
        why = f"runbook {s.name}: a person checks" if mine else "no automatic change available (bounds reached or held back); a person checks"
        out.append(view.propose(NAME, s, notice_target(s.key), None, s.summary, why, "a person follows runbooks/" + s.name + ".md"))
    return out
