"""The progress bar of `andrea train`: tokens, rate, and a remaining time a person can read."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

DAY = 86_400.0
# From this remaining time on, the bar says days instead of H:MM:SS (13317:40:36 says little).
LONG_RUN = 2 * DAY


def format_eta(seconds: float) -> str:
    """'1:02:03' below two days, '555 days' from there on."""
    if seconds >= LONG_RUN:
        return f"{seconds / DAY:,.0f} days"
    return tqdm.format_interval(seconds)


def format_speed(tokens_per_s: float | None) -> str:
    """A tokens/s figure as the bar prints it ('1.11k'), for every other place that shows it."""
    return "-" if tokens_per_s is None else tqdm.format_sizeof(tokens_per_s)


class RunBar(tqdm):
    """tqdm, with the remaining time in days once it passes two days, and as its rate the run's
    tokens/s (train.metrics.Throughput, given by `set_rate` after each step) instead of tqdm's
    own smoothed one, so the bar's last state says what the end record and `andrea runs` say."""

    run_rate: float | None = None

    def set_rate(self, tokens_per_s: float | None) -> None:
        self.run_rate = tokens_per_s

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        if self.run_rate:
            d["rate"] = self.run_rate
        return d

    @staticmethod
    def format_meter(n: float, total: float, elapsed: float, **kw: Any) -> str:
        rate = kw.get("rate") or ((n - kw.get("initial", 0)) / elapsed if elapsed else None)
        if total and rate and (total - n) / rate >= LONG_RUN:
            eta = format_eta((total - n) / rate)
            kw["bar_format"] = ("{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<" + eta
                                + ", {rate_fmt}{postfix}]")
        return tqdm.format_meter(n, total, elapsed, **kw)


def long_run_note(tokens_left: int, tokens_per_s: float, device_type: str,
                  preset: str) -> str | None:
    """One line when the rest of the run would take two days or more at the measured speed;
    on a CPU, it says the preset wants a GPU."""
    seconds = tokens_left / tokens_per_s if tokens_per_s > 0 else 0.0
    if seconds < LONG_RUN:
        return None
    line = (f"note: at {tokens_per_s:,.0f} tokens/s the rest of this run takes about "
            f"{format_eta(seconds)}")
    if device_type == "cpu":
        line += (f"; {preset} is a GPU job on this scale (lower train.max_steps for a trial "
                 f"here, or run it on a GPU)")
    return line
