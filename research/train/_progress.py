import os
import sys
import time

from tqdm.auto import tqdm


def interactive() -> bool:
    """Progress bars only on a terminal; `CI=true` or piped output gets plain log lines instead."""
    return sys.stderr.isatty() and os.environ.get("CI", "").lower() not in ("1", "true", "yes")


def format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


class Progress:
    """A tqdm bar over steps on a terminal; otherwise one line per `report` call on stderr."""

    def __init__(self, total: int, initial: int = 0, desc: str = "train", enabled: bool = True):
        self.total = total
        self.desc = desc
        self.enabled = enabled
        self._bar = (
            tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, leave=True)
            if enabled and interactive()
            else None
        )
        self._start = time.perf_counter()

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(format_metrics(metrics), refresh=False)
        elif self.enabled:
            elapsed = time.perf_counter() - self._start
            print(f"[{self.desc}] step {step}/{self.total} {format_metrics(metrics)} ({elapsed:.1f}s)",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
