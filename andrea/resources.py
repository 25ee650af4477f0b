"""Where the bundled presets and kernel sources live, and which CPU this is.

In a wheel they sit inside the package (`andrea/configs`, `andrea/kernels`, see pyproject's
force-include); in a source checkout or an editable install they sit at the repository's top level.
"""

import os
import platform
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _bundled(name: str) -> Path:
    inside = _PACKAGE / name
    if inside.is_dir():
        return inside
    return _PACKAGE.parent / name


def configs_dir() -> Path:
    return _bundled("configs")


def kernels_dir() -> Path:
    return _bundled("kernels")


def cache_dir() -> Path:
    """$ANDREA_CACHE_DIR, else $XDG_CACHE_HOME/andrea, else ~/.cache/andrea (not created here)."""
    if os.environ.get("ANDREA_CACHE_DIR"):
        return Path(os.environ["ANDREA_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "andrea"


def cpu_name() -> str:
    """The CPU's model name (lscpu's "Model name"), which a benchmark prints beside its figures;
    the machine type (e.g. x86_64) where the kernel does not say."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
