"""Progress of long commands, on a terminal and in logs.

A rich progress bar is drawn on a terminal only; when the output goes to a file or a CI log
it draws nothing, and a run of many minutes looks dead. :class:`LoggedProgress` is a rich
``Progress`` that also prints, when the console is not a terminal, one plain line as the first
step starts and one per finished step: what finished, how long it took and the time since the
start (seconds).
"""

from __future__ import annotations

import time

from rich.progress import Progress

__all__ = ["LoggedProgress", "plain_printer"]


def plain_printer(console, style: str | None = None):
    """A function printing one line on ``console`` as it is: no rich markup (a plugin's error
    such as ``index [i]`` or ``[/tmp]`` would lose text or raise ``MarkupError``), no
    highlighting, and no wrapping at the console width (80 columns off a terminal)."""

    def say(line: str) -> None:
        console.print(line, style=style, markup=False, highlight=False, soft_wrap=True)

    return say


class LoggedProgress(Progress):
    """``rich.progress.Progress`` plus, off a terminal, one log line per :meth:`advance` and one as
    the first step starts.

    The line names the task's description at the time of the call (the step that finished),
    e.g. ``vegas: collect2 γ=4 s=0.05 done in 12.3 s (3/9, elapsed 45 s) τ=3.41``; ``note``
    adds a result to it. The first description set by :meth:`update` is also said when set
    (``… started``), so that a log shows what a long first step is doing. On a terminal only
    the bar is drawn.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._started = time.monotonic()
        self._last = self._started
        self._working = False  # a step has started (said once off a terminal: the first may take minutes)
        self._say = plain_printer(self.console)

    def update(self, task_id, *args, description: str | None = None, **kwargs) -> None:
        super().update(task_id, *args, description=description, **kwargs)
        if description is not None and not self._working and not self.console.is_terminal:
            self._say(f"{description} started")
        self._working = self._working or description is not None

    def advance(self, task_id, advance: float = 1, note: str = "") -> None:  # noqa: D102
        super().advance(task_id, advance)
        now = time.monotonic()
        if not self.console.is_terminal:
            task = self._tasks[task_id]
            total = f"/{task.total:g}" if task.total is not None else ""
            self._say(f"{task.description} done in {now - self._last:.1f} s ({task.completed:g}{total}, "
                      f"elapsed {now - self._started:.0f} s){' ' + note if note else ''}")
        self._last = now

    def skip(self, task_id, advance: float = 1) -> None:
        """Advance without a log line (a step that needed no work, e.g. resumed from a file)."""
        super().advance(task_id, advance)
        self._last = time.monotonic()
