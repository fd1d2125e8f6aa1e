"""Reading the operator's own message: does it ask for a change, and does a proposal match it?

Pure functions over the user's text only. The chat graph decides from them
whether the proposal step runs at all (so no tool output can open it), and a
proposal the model derives must name a target the message names and a value
the message contains (so no text from elsewhere can slip a value in).
"""

from __future__ import annotations

import math
import re

from agents.knobs import CHOICE_KNOBS, REPLICAS

CHANGE_VERBS = (
    "scale",
    "set",
    "change",
    "increase",
    "decrease",
    "raise",
    "lower",
    "reduce",
    "bump",
    "switch",
    "enable",
    "disable",
    "turn",
    "add",
    "remove",
    "drop",
    "make",
    "put",
    "adjust",
    "update",
    "use",
    "move",
)
UP_VERBS = ("increase", "raise", "add", "bump", "grow")
DOWN_VERBS = ("decrease", "lower", "reduce", "remove", "drop", "cut", "shrink")
QUESTION_WORDS = (
    "what",
    "why",
    "how",
    "when",
    "where",
    "which",
    "who",
    "whose",
    "is",
    "are",
    "was",
    "were",
    "does",
    "do",
    "did",
    "has",
    "have",
    "had",
    "should",
    "shall",
    "may",
    "might",
)
#: Polite forms that still ask for the change ("could you scale ...").
POLITE = re.compile(r"^(please|pls|kindly|can you|could you|would you|will you)\b")
TRUE_WORDS = ("enable", "enabled", "on", "true", "yes")
FALSE_WORDS = ("disable", "disabled", "off", "false", "no")

#: How an operator names each replica target (after `normalize`).
ROLE_ALIASES: dict[str, tuple[str, ...]] = {
    "prefill": ("prefill", "p", "prefiller"),
    "relay_decode": ("relay decode", "relay", "rld", "relaydecode", "relay decoder"),
    "main_decode": ("main decode", "md", "maindecode", "main decoder", "main"),
}
#: Words that name each knob; a knob proposal needs one of them in the message.
KNOB_ALIASES: dict[str, tuple[str, ...]] = {
    "routing.max_wan_transfer_ms": ("max wan transfer ms", "wan", "transfer", "threshold"),
    "routing.min_hit_rate": ("min hit rate", "hit rate", "hit", "threshold"),
    "routing.max_relay_load": ("max relay load", "relay load"),
    "routing.singular.min_prompt_tokens": ("singular",),
    "routing.singular.max_output_tokens": ("singular",),
    "routing.singular.max_hit_rate": ("singular",),
    "routing.singular.enabled": ("singular",),
    "handoff.mode": ("handoff", "mode", "one shot", "catch up"),
    "handoff.catch_up_threshold_tokens": ("catch up", "threshold"),
    "handoff.relay_cap_tokens": ("relay cap", "cap"),
    "handoff.min_relay_cap_tokens": ("min relay cap", "cap"),
}

_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?")
#: Unit conversions an operator may leave to the model: s <-> ms, percent -> ratio.
_SCALES = (1.0, 1000.0, 0.001, 0.01)


def normalize(text: str) -> str:
    """Lower case, `-`, `_` and `.` between words as spaces, single spaces."""
    text = text.lower()
    text = re.sub(r"(?<=[a-z])[-_.](?=[a-z])", " ", text)
    text = text.replace("_", " ")
    return re.sub(r"\s+", " ", text).strip()


def has_word(text: str, phrase: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(phrase)}(?![\w])", text) is not None


def numbers_in(text: str) -> list[float]:
    return [float(n) for n in _NUMBER.findall(text)]


def _mentions_value_word(text: str) -> bool:
    words = {normalize(str(v)) for values in CHOICE_KNOBS.values() for v in values if isinstance(v, str)}
    switches = [w for w in (*TRUE_WORDS, *FALSE_WORDS) if w not in ("yes", "no")]
    return any(has_word(text, w) for w in (*words, *switches))


def asks_for_change(message: str) -> bool:
    """True when the message is an instruction to change something, with a value.

    A question ("should we scale MD to 10?", "what did the agents change?")
    is not one: it gets an answer, never a proposal.
    """
    text = normalize(message)
    if not text:
        return False
    first = text.split(" ", 1)[0]
    if first in QUESTION_WORDS or (text.endswith("?") and not POLITE.match(text)):
        return False
    if not any(has_word(text, v) for v in CHANGE_VERBS):
        return False
    return bool(numbers_in(text)) or _mentions_value_word(text)


def mentions_target(target: str, message: str) -> bool:
    """The message names the target (its path, or a word operators use for it)."""
    text = normalize(message)
    if has_word(text, normalize(target)):
        return True
    if target.startswith(REPLICAS):
        aliases = ROLE_ALIASES.get(target.removeprefix(REPLICAS), ())
    else:
        aliases = KNOB_ALIASES.get(target, ())
    return any(has_word(text, a) for a in aliases)


def number_grounded(value: float, message: str) -> bool:
    """The message contains this number (allowing s/ms and percent conversions)."""
    for n in numbers_in(message):
        for scale in _SCALES:
            if math.isclose(abs(value), abs(n) * scale, rel_tol=1e-9, abs_tol=1e-12):
                return True
    return False


def choice_grounded(value: object, message: str) -> bool:
    """The message contains this choice (`one_shot` as "one-shot", True as "enable"/"on")."""
    text = normalize(message)
    if isinstance(value, bool):
        return any(has_word(text, w) for w in (TRUE_WORDS if value else FALSE_WORDS))
    return has_word(text, normalize(str(value)))


def direction(message: str) -> int:
    """+1 when the message only says "more" (increase, add, ...), -1 when it only says "less", else 0."""
    text = normalize(message)
    up = any(has_word(text, v) for v in UP_VERBS)
    down = any(has_word(text, v) for v in DOWN_VERBS)
    return up - down
