"""Progress of long work: reading a model, uploading its weights, building its pipelines, calibrating.

The work reports through :func:`task` (and :func:`advance` where the task was opened further
up); what listens is installed for a block of code with :func:`reporting`. Nothing listens by
default, so a library call such as ``vkpool.Session(...)`` prints nothing unless asked::

    from vkpool import progress
    from vkpool.session import Session

    with progress.reporting(progress.Console()):
        session = Session("model.onnx")

The reporter lives in a context variable: it follows the code of one thread (or one asyncio
task); threads started inside the block do not inherit it. A reporter is any callable taking an
:class:`Update`; :class:`Console` draws them on stderr (a bar per stage on a terminal, plain lines
otherwise), the daemon keeps the latest one of each model being loaded for ``vkpool status``.
"""
from __future__ import annotations

import contextvars
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TextIO

#: stage → what it is called in messages
STAGES = {
    "hash": "identifying",
    "load": "reading",
    "upload": "uploading weights",
    "compile": "building pipelines",
    "calibrate": "calibrating",
}


@dataclass(frozen=True)
class Update:
    """Where one stage of the work stands. ``total`` None: its size is unknown (a spinner)."""

    stage: str
    what: str
    done: int
    total: int | None
    unit: str = ""           # "B": ``done`` and ``total`` are bytes; "": items
    elapsed_s: float = 0.0
    finished: bool = False   # the stage is done
    failed: bool = False     # the stage ended by an exception (the caller reports the error)

    @property
    def fraction(self) -> float | None:
        if self.finished:
            return 1.0
        if not self.total:
            return None
        return min(1.0, self.done / self.total)

    def describe(self) -> str:
        """``uploading weights to vk0: 45% (115 MiB of 256 MiB)``."""
        from vkpool.units import format_size

        text = f"{STAGES.get(self.stage, self.stage)}{' ' + self.what if self.what else ''}"
        fraction = self.fraction
        if self.finished:
            return f"{text}: done in {self.elapsed_s:.1f} s"
        if fraction is None:
            return f"{text}: {self.elapsed_s:.0f} s"
        amount = (f"{format_size(self.done)} of {format_size(self.total or 0)}" if self.unit == "B"
                  else f"{self.done} of {self.total}")
        return f"{text}: {fraction:.0%} ({amount})"


Reporter = Callable[[Update], None]


@dataclass(frozen=True)
class _State:
    reporter: Reporter | None = None
    task: "Task | None" = None


_state: contextvars.ContextVar[_State] = contextvars.ContextVar("vkpool_progress", default=_State())


class Task:
    """One stage of work reporting to the reporter current when it was made; a context manager
    that reports its start and its end, and is the target of :func:`advance` inside it."""

    def __init__(self, reporter: Reporter, stage: str, total: int | None, unit: str, what: str) -> None:
        self.reporter, self.stage, self.total, self.unit, self.what = reporter, stage, total, unit, what
        self.done = 0
        self._started = time.monotonic()
        self._token: contextvars.Token[_State] | None = None

    def _send(self, finished: bool = False, failed: bool = False) -> None:
        self.reporter(Update(self.stage, self.what, self.done, self.total, self.unit,
                             time.monotonic() - self._started, finished, failed))

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._send()

    def __enter__(self) -> "Task":
        self._token = _state.set(_State(self.reporter, self))
        self._started = time.monotonic()
        self._send()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._token is not None
        _state.reset(self._token)
        self._send(finished=exc[0] is None, failed=exc[0] is not None)


class _Silent:
    """The task of work nobody listens to."""

    def advance(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_SILENT = _Silent()


def task(stage: str, total: int | None = None, *, unit: str = "", what: str = "") -> Task | _Silent:
    """A stage of work (``with progress.task("upload", nbytes, unit="B", what="to vk0") as t:
    ... t.advance(n)``); does nothing when no reporter listens."""
    reporter = _state.get().reporter
    if reporter is None:
        return _SILENT
    return Task(reporter, stage, total, unit, what)


def advance(stage: str, n: int = 1) -> None:
    """Advance the innermost open task when it is of ``stage``, for code that does a part of a
    stage opened by its caller (a weight upload, one pipeline build)."""
    current = _state.get().task
    if current is not None and current.stage == stage:
        current.advance(n)


@contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Send the progress of the work inside the block to ``reporter``."""
    token = _state.set(_State(reporter, None))
    try:
        yield reporter
    finally:
        _state.reset(token)


@contextmanager
def muted() -> Iterator[None]:
    """Inside the block nothing is reported (work that is itself one step of a task)."""
    token = _state.set(_State())
    try:
        yield
    finally:
        _state.reset(token)


@contextmanager
def interlude() -> Iterator[None]:
    """Around a print to the terminal while bars may be drawn there: they are cleared first and
    drawn again after."""
    reporter = _state.get().reporter
    if isinstance(reporter, Console) and reporter.bars:
        from tqdm import tqdm

        with tqdm.external_write_mode(file=reporter.file):
            yield
    else:
        yield


class Console:
    """Draws updates on ``file`` (stderr): a ``tqdm`` bar per stage when it is a terminal, else
    one plain line when a stage has run ``delay_s``, then one every ``every_s`` while it runs,
    and one when it ends. Stages shorter than ``delay_s`` (a cached build, a small upload) show
    nothing."""

    def __init__(self, file: TextIO | None = None, *, bars: bool | None = None, delay_s: float = 0.5,
                 every_s: float = 5.0, prefix: str = "vkpool: ") -> None:
        self.file = file if file is not None else sys.stderr
        self.bars = _is_terminal(self.file) if bars is None else bars
        self.delay_s, self.every_s, self.prefix = delay_s, every_s, prefix
        self._bars: dict[tuple[str, str], Any] = {}
        self._shown: dict[tuple[str, str], float] = {}  # (stage, what) → when its last line was written

    def __call__(self, update: Update) -> None:
        try:
            if self.bars:
                self._bar(update)
            else:
                self._line(update)
        except OSError:  # stderr closed or a broken pipe: the work goes on without its progress
            pass

    def _line(self, u: Update) -> None:
        key = (u.stage, u.what)
        if u.finished or u.failed:
            shown = self._shown.pop(key, None)
            if u.finished and (shown is not None or u.elapsed_s >= self.delay_s):
                self._write(u.describe())
            return
        if u.elapsed_s < self.delay_s:
            return
        now = time.monotonic()
        last = self._shown.get(key)
        if last is None or now - last >= self.every_s:
            self._shown[key] = now
            self._write(u.describe())

    def _bar(self, u: Update) -> None:
        from tqdm import tqdm

        key = (u.stage, u.what)
        bar = self._bars.get(key)
        if bar is None:
            if u.finished or u.failed:
                return
            bar = self._bars[key] = tqdm(
                total=u.total, desc=f"{STAGES.get(u.stage, u.stage)}{' ' + u.what if u.what else ''}",
                unit=u.unit or "it", unit_scale=u.unit == "B", unit_divisor=1024 if u.unit == "B" else 1000,
                file=self.file, delay=self.delay_s, leave=False, dynamic_ncols=True)
        bar.update(u.done - bar.n)
        if u.finished or u.failed:
            bar.close()
            del self._bars[key]

    def end(self, stage: str, what: str) -> None:
        """Forget a stage whose end was not seen (updates sampled from afar), drawing nothing more."""
        bar = self._bars.pop((stage, what), None)
        if bar is not None:
            bar.close()
        self._shown.pop((stage, what), None)

    def _write(self, text: str) -> None:
        print(f"{self.prefix}{text}", file=self.file, flush=True)

    def close(self) -> None:
        """Take down the bars still drawn (updates that stopped coming before their stage ended)."""
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


def _is_terminal(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):
        return False
