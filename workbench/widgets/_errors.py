"""A widget's inline error, in one place: the error area under its controls, what shows and clears it, the guard a
callback runs in (an exception becomes that line, not a kernel traceback, and the widget keeps working), and the
line for a static ``_repr_html_``.

A widget mixes in :class:`InlineError`, places ``self._error_area()`` among its children, and reads::

    with self._guard("spec not applied", catch=ValueError) as failed:
        new = resolve(text)
    if failed:
        return False  # the reason is on screen; the last valid state stays
    self._clear_error()

``widget.error`` is the text on show ('' when none); the area shows it HTML-escaped (:func:`error_html`). This is
the one path: no ``except`` in the widgets shows an error any other way (``tests/widgets/test_error_paths.py``
holds them to it). A panel that owns an error (``self._guard("export", clear="own")``) clears it when it next
succeeds, and leaves another panel's error on show.
"""

from __future__ import annotations

import typing as tp

from workbench.widgets._html import error_html

__all__ = ["Guard", "InlineError", "error_message"]

Errors = type[BaseException] | tuple[type[BaseException], ...]


def error_message(e: BaseException, prefix: str = "", *, plain: Errors = ()) -> str:
    """How an exception reads inline: ``prefix: TypeName: text``, without ``prefix: `` when ``prefix`` is empty and
    without ``TypeName: `` for the ``plain`` types (expected errors, whose text says it all)."""
    text = f"{e}" if isinstance(e, plain) else f"{type(e).__name__}: {e}"
    return f"{prefix}: {text}" if prefix else text


class Guard:
    """A context manager that turns an exception of ``catch`` raised in its block into ``show(message)`` and
    swallows it; truthy afterwards when it did (``exception`` holds it). Other exceptions pass through.

    ``clear``: when the block succeeds, True calls ``show("")``, a callable is called."""

    def __init__(self, show: tp.Callable[[str], None], prefix: str = "", *, catch: Errors = Exception,
                 plain: Errors | None = None, suffix: str = "", clear: bool | tp.Callable[[], None] = False):
        self._show, self._prefix, self._catch, self._suffix, self._clear = show, prefix, catch, suffix, clear
        # errors caught by a narrower `catch` are the expected ones: their text alone, as the widgets always said
        self._plain = plain if plain is not None else (() if catch is Exception else catch)
        self.exception: BaseException | None = None

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: tp.Any, e: BaseException | None, tb: tp.Any) -> bool:
        if e is None:
            if callable(self._clear):
                self._clear()
            elif self._clear:
                self._show("")
            return False
        if not isinstance(e, self._catch):
            return False
        self.exception = e
        self._show(error_message(e, self._prefix, plain=self._plain) + self._suffix)
        return True

    def __bool__(self) -> bool:
        return self.exception is not None


class InlineError:
    """Mixin: one inline error line per widget (an ``ipywidgets.HTML``, ``self._error``) and its text
    (``self.error``). A widget calls :meth:`_error_area` once while it builds its children."""

    _error: tp.Any = None  # the area (ipywidgets.HTML), from _error_area()
    _error_text = ""
    _error_source = ""  # who showed it: a guard's prefix, '' for a direct _show_error

    def _error_area(self, area: tp.Any = None) -> tp.Any:
        """The error area, made now (an empty ``ipywidgets.HTML``) or ``area`` (e.g. a status line that also
        shows progress); place it among the children."""
        if area is None:
            import ipywidgets

            area = ipywidgets.HTML("")
        self._error, self._error_text, self._error_source = area, "", ""
        return area

    @property
    def error(self) -> str:
        """The inline error's text ('' when none)."""
        return self._error_text

    def _show_error(self, message: str, source: str = "") -> None:
        """Show ``message`` (HTML-escaped) in the error area, said by ``source``; '' clears it."""
        self._error_text, self._error_source = message, source if message else ""
        self._error.value = error_html(message)

    def _clear_error(self, source: str | None = None) -> None:
        """Clear the error; with ``source``, only when that source showed it."""
        if source is None or source == self._error_source:
            self._show_error("")

    def _guard(self, prefix: str = "", *, catch: Errors = Exception, plain: Errors | None = None, suffix: str = "",
               clear: bool | tp.Literal["own"] = False) -> Guard:
        """``with self._guard(...) as failed:`` shows an exception of ``catch`` raised in the block inline as
        ``prefix: TypeName: text`` + ``suffix`` and swallows it (``failed`` is then truthy). The type's name is left
        out for ``plain`` (by default: the types of a narrower ``catch``). ``clear``: a block that succeeds clears
        the error (True), or only an error this ``prefix`` showed ("own")."""
        on_success = (lambda: self._clear_error(prefix)) if clear == "own" else clear
        return Guard(lambda message: self._show_error(message, prefix), prefix, catch=catch, plain=plain,
                     suffix=suffix, clear=on_success)

    def _error_html(self) -> str:
        """The error line for a static ``_repr_html_`` ('' when none)."""
        return error_html(self._error_text)
