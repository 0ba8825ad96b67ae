"""The shared inline error (``workbench.widgets._errors``): the area, the escaped line, the callback guard, the
line in a static ``_repr_html_``; on a VBox widget and on a plain class holding ``.widget``, as the views do."""

import ipywidgets as w
import pytest

from workbench.widgets._errors import InlineError, error_message
from workbench.widgets._html import error_html


class Box(InlineError, w.VBox):
    """A widget in the shape of the views: a button whose callback may raise, then clears on a good click."""

    def __init__(self):
        self.button = w.Button(description="go")
        self.fail_with: BaseException | None = None
        self.done = 0
        super().__init__([self.button, self._error_area()])
        self.button.on_click(lambda _: self.go())

    def go(self) -> bool:
        with self._guard("go", clear=True) as failed:
            if self.fail_with is not None:
                raise self.fail_with
            self.done += 1
        return not failed

    def _repr_html_(self) -> str:
        return f"<div>box</div>{self._error_html()}"


class Plain(InlineError):
    def __init__(self):
        self.status = self._error_area(w.HTML())  # a status line that is also the error area
        self.widget = w.VBox([self.status])


def test_message_is_escaped_and_cleared():
    box = Box()
    assert box.error == "" and box._error.value == "" and box._error in box.children
    box._show_error('<script>alert("x")</script> & a<b')
    assert box.error == '<script>alert("x")</script> & a<b'  # the text as said
    assert box._error.value == error_html(box.error)
    assert "<script>" not in box._error.value and "&lt;script&gt;" in box._error.value
    assert "&amp; a&lt;b" in box._error.value and 'class="wb-error"' in box._error.value
    assert box._repr_html_() == f"<div>box</div>{box._error.value}"
    box._clear_error()
    assert box.error == "" and box._error.value == "" and box._repr_html_() == "<div>box</div>"


def test_guarded_callback_shows_the_error_inline_and_does_not_raise():
    box = Box()
    box.fail_with = ValueError("bad <value>")
    box.button.click()  # the callback raised inside the guard: nothing escapes
    assert box.error == "go: ValueError: bad <value>" and box.done == 0
    assert "bad &lt;value&gt;" in box._error.value and "<value>" not in box._error.value
    assert not box.go() and box.error == "go: ValueError: bad <value>"
    box.fail_with = None
    box.button.click()  # the next good call clears it; the widget kept working
    assert box.error == "" and box._error.value == "" and box.done == 1
    assert box.go() and box.done == 2


def test_guard_catches_only_what_it_is_told():
    box = Box()
    with box._guard(catch=ValueError) as failed:
        raise ValueError("expected")
    assert failed and isinstance(failed.exception, ValueError)
    assert box.error == "expected"  # a narrower catch: the expected error's text alone
    with pytest.raises(KeyError), box._guard(catch=ValueError):
        raise KeyError("not mine")
    assert box.error == "expected"  # untouched by what passed through
    box.fail_with = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):  # never swallowed: the user's interrupt stops the cell
        box.go()
    with box._guard() as failed:
        pass
    assert not failed and box.error == "expected"  # no clear unless asked


def test_guard_message_prefix_plain_and_suffix():
    box = Box()
    with box._guard(plain=(ValueError, KeyError), suffix=" (still showing the last valid layout)"):
        raise KeyError("fsdp")
    assert box.error == "'fsdp' (still showing the last valid layout)"
    with box._guard(plain=(ValueError, KeyError), suffix="!"):
        raise ZeroDivisionError("boom")
    assert box.error == "ZeroDivisionError: boom!"
    assert error_message(RuntimeError("x")) == "RuntimeError: x"
    assert error_message(RuntimeError("x"), "apply", plain=RuntimeError) == "apply: x"


def test_a_plain_class_can_share_its_status_line():
    p = Plain()
    assert p._error is p.status and p.status.value == "" and p.error == ""
    with p._guard("rank") as failed:
        raise TypeError("no <int>")
    assert failed and p.error == "rank: TypeError: no <int>" and "no &lt;int&gt;" in p.status.value
    p._clear_error()
    assert p.status.value == "" and p.error == ""


def test_a_panel_clears_only_its_own_error():
    box = Box()
    with box._guard("export", clear="own"):
        raise ValueError("no code")
    assert box.error == "export: ValueError: no code"
    with box._guard("ledger", clear="own"):
        pass  # another panel's success: the export's error stays said
    assert box.error == "export: ValueError: no code"
    box._clear_error("ledger")
    assert box.error == "export: ValueError: no code"
    with box._guard("export", clear="own"):
        pass
    assert box.error == "" and box._error.value == ""
    box._show_error("said directly")
    with box._guard("export", clear="own"):
        pass
    assert box.error == "said directly"
    box._clear_error()  # no source: whatever is on show
    assert box.error == ""
