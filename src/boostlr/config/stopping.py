"""The two keys that stop a run early to be resumed: ``train.save_on_signal`` and
``train.time_limit``, read and checked here (torch-free: validation and the trainer share it).
"""

from __future__ import annotations

import re
import signal

from boostlr.errors import ConfigError

_DURATION = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_signals(spec: str) -> list[signal.Signals]:
    """``"SIGTERM,SIGUSR1"`` (or ``TERM,USR1``) as signals; empty is none."""
    found = []
    for name in (s.strip().upper() for s in spec.split(",") if s.strip()):
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full in ("SIGKILL", "SIGSTOP") or not hasattr(signal, full):
            raise ConfigError(
                f"train.save_on_signal: {name!r} is not a signal that can be handled: use "
                "names like SIGTERM,SIGUSR1 (empty turns saving on a signal off)"
            )
        found.append(signal.Signals[full])
    return found


def parse_duration(text: str) -> float:
    """``"3h50m"``, ``"1d2h"``, ``"90m"``, ``"45s"``, ``"3600"`` or SLURM's ``"3:50:00"``
    as seconds."""
    text = text.strip().lower()
    if text.isdigit():
        return float(text)
    if re.fullmatch(r"\d+(:\d{1,2}){1,2}", text):
        parts = [int(p) for p in text.split(":")]
        while len(parts) < 3:
            parts.insert(0, 0)
        return float(parts[0] * 3600 + parts[1] * 60 + parts[2])
    match = _DURATION.match(text)
    if not text or match is None:
        raise ConfigError(
            f"train.time_limit: cannot read {text!r} as a duration: write e.g. 3h50m, 90m, "
            "1d2h, 3600 (seconds) or 3:50:00; 'auto' (SLURM's end time) or 'none'"
        )
    d, h, m, s = (int(g or 0) for g in match.groups())
    return float(((d * 24 + h) * 60 + m) * 60 + s)


def check_stop_config(save_on_signal: str, time_limit: str) -> None:
    """Refuse an unreadable ``train.save_on_signal`` or ``train.time_limit`` (exit 2)."""
    parse_signals(save_on_signal)
    if time_limit.strip().lower() not in ("auto", "none"):
        if parse_duration(time_limit) <= 0:
            raise ConfigError("train.time_limit must be a positive duration, 'auto' or 'none'")
