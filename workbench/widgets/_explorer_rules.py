"""The ShardingExplorer's rules editor: PartitionAxis fields, regex override rules, runtime mode.

The editor only reads and writes text and choices: :meth:`RulesEditor.read` turns the controls into
``(partition_axis, rules, mode)`` (raising ``ValueError`` / ``TypeError`` on text that does not parse),
and the explorer decides whether the result resolves. :meth:`RulesEditor.show` puts a valid state
back into the controls, with the fields that matter for that layout.
"""

from __future__ import annotations

import typing as tp

import ipywidgets as widgets

from workbench.core import axes as ax
from workbench.core.sharding.spec_text import format_axes, format_entry, parse_axes, parse_entry
from workbench.core.views.explore import Layout

MODES = (("MODE_TRAIN", ax.MODE_TRAIN), ("MODE_PREFILL", ax.MODE_PREFILL), ("MODE_DECODE", ax.MODE_DECODE),
         ("MODE_INSERT", ax.MODE_INSERT))
_GROUP_TITLES = {"roles": "parallelism roles → mesh axis", "parameters": "semantic axes of the parameters",
                 "inputs": "token batch of a step", "kv_cache": "KV cache (decode mode)"}
_SMALL = {"description_width": "225px"}


def _heading(text: str) -> widgets.HTML:
    return widgets.HTML(f'<div style="font-size:12px;font-weight:600;margin-top:4px">{text}</div>')


EDITOR_WIDTH_PX = 430


class _Rule:
    """One override row: regex over parameter paths -> semantic axes, and a remove button."""

    def __init__(self, pattern: str, axes_text: str, on_change: tp.Callable[[], None],
                 on_remove: tp.Callable[[_Rule], None]):
        self.pattern = widgets.Text(pattern, placeholder="regex over paths, e.g. embed_tokens",
                                    continuous_update=False, layout=widgets.Layout(width="190px"))
        self.axes = widgets.Text(axes_text, placeholder="axes, e.g. TP, EMPTY", continuous_update=False,
                                 layout=widgets.Layout(width="170px"))
        self.remove = widgets.Button(icon="trash", tooltip="remove this rule", layout=widgets.Layout(width="36px"))
        self.remove.add_class("wb-rule-remove")
        self.pattern.add_class("wb-rule-pattern")
        self.axes.add_class("wb-rule-axes")
        for w in (self.pattern, self.axes):
            w.observe(lambda _: on_change(), names="value")
        self.remove.on_click(lambda _: on_remove(self))
        self.box = widgets.HBox([self.pattern, self.axes, self.remove])

    def read(self) -> tuple[str, tuple] | None:
        pattern, text = self.pattern.value.strip(), self.axes.value.strip()
        if not pattern or not text:
            return None  # a row being filled in: it counts once both are given
        return pattern, parse_axes(text)


class RulesEditor:
    """Controls for a PartitionAxis, override rules and the mode; ``on_edit()`` is called after each edit."""

    def __init__(self, layout: Layout, on_edit: tp.Callable[[], None]):
        self._on_edit = on_edit
        self._quiet = False
        self.mode = widgets.Dropdown(options=MODES, value=layout.mode, description="runtime mode",
                                     style=_SMALL, layout=widgets.Layout(width="380px"))
        self.mode.add_class("wb-mode")
        self.mode.observe(lambda _: self._changed(), names="value")
        self.fields: dict[str, widgets.Dropdown | widgets.Text] = {}
        self._groups = widgets.VBox()
        self._rules: list[_Rule] = []
        self._rules_box = widgets.VBox()
        add = widgets.Button(description="add rule", icon="plus", layout=widgets.Layout(width="110px"))
        add.add_class("wb-add-rule")
        add.on_click(lambda _: self.add_rule())
        # wide enough for its widest row (a rule: 190 + 170 + 36 px and margins; the 400 px accordion), and kept
        # at that width beside the memory column: shrunk, every box in it grew a horizontal scrollbar
        self.widget = widgets.VBox([
            self.mode, self._groups, _heading("override rules (first match wins; regex → semantic axes)"),
            self._rules_box, add], layout=widgets.Layout(width=f"{EDITOR_WIDTH_PX}px", flex="0 0 auto"))
        self.widget.add_class("wb-rules-editor")
        self.show(layout)

    # -- reading -----------------------------------------------------------------------------------------
    def read(self, base: ax.PartitionAxis) -> tuple[ax.PartitionAxis, tuple[tuple[str, tp.Any], ...], str]:
        """``(partition_axis, rules, mode)`` from the controls; fields not shown keep ``base``'s values."""
        changes: dict[str, tp.Any] = {}
        for name, control in self.fields.items():
            text = control.value
            try:
                changes[name] = text if isinstance(control, widgets.Dropdown) else parse_entry(text)
            except ValueError as e:
                raise ValueError(f"PartitionAxis.{name} = {text!r}: {e}") from None
        rules = tuple(r for r in (rule.read() for rule in self._rules) if r is not None)
        return base.replace(**changes), rules, self.mode.value

    # -- writing -----------------------------------------------------------------------------------------
    def show(self, layout: Layout) -> None:
        """Controls for ``layout``: its mode, the fields that matter for it, its rules."""
        self._quiet = True
        try:
            self.mode.value = layout.mode
            groups = layout.editor_fields()
            wanted = [f for names in groups.values() for f in names]
            if list(self.fields) != wanted or self._mesh_axes != tuple(layout.mesh.axis_names):
                self._build_fields(layout, groups)
            pa = layout.partition_axis
            for name, control in self.fields.items():
                value = getattr(pa, name)
                control.value = value if isinstance(control, widgets.Dropdown) else format_entry(value)
            if not self._rules_are(layout.rules):
                self._rules = []
                for pattern, axes in layout.rules:
                    self._rules.append(_Rule(pattern, format_axes(axes), self._changed, self._remove))
                self._rules_box.children = [r.box for r in self._rules]
        finally:
            self._quiet = False

    _mesh_axes: tuple[str, ...] = ()

    def _rules_are(self, rules: tuple[tuple[str, tp.Any], ...]) -> bool:
        """Whether the filled-in rows read as ``rules`` do, text for text (a row in other words, or one that does
        not parse, is rewritten as the layout says it)."""
        typed = [(r.pattern.value.strip(), r.axes.value.strip()) for r in self._rules]
        return [t for t in typed if all(t)] == [(pattern, format_axes(axes)) for pattern, axes in rules]

    def _build_fields(self, layout: Layout, groups: dict[str, tuple[str, ...]]) -> None:
        """Roles and the parameters' fields in view; the batch and KV cache fields in a folded section."""
        self._mesh_axes = tuple(layout.mesh.axis_names)
        pa = layout.partition_axis
        self.fields, shown, folded = {}, [], []
        for group, names in groups.items():
            if not names:
                continue
            controls = []
            for name in names:
                if group == "roles":
                    value = getattr(pa, name)
                    options = list(self._mesh_axes) + ([value] if value not in self._mesh_axes else [])
                    control = widgets.Dropdown(options=options, value=value, description=name, style=_SMALL,
                                               layout=widgets.Layout(width="330px"))
                else:
                    control = widgets.Text(format_entry(getattr(pa, name)), description=name, style=_SMALL,
                                           continuous_update=False, layout=widgets.Layout(width="380px"),
                                           tooltip="mesh axes or roles, e.g. 'tp', 'FSDP, DP' or 'None'")
                control.add_class(f"wb-field-{name}")
                control.observe(lambda _: self._changed(), names="value")
                self.fields[name] = control
                controls.append(control)
            if group in ("roles", "parameters"):
                shown += [_heading(_GROUP_TITLES[group]), *controls]
            else:
                folded.append((_GROUP_TITLES[group], widgets.VBox(controls)))
        more = widgets.Accordion(children=[box for _, box in folded], titles=tuple(t for t, _ in folded),
                                 selected_index=None, layout=widgets.Layout(width="400px"))
        self._groups.children = [*shown, more]
    def add_rule(self, pattern: str = "", axes: str = "") -> None:
        """A new override row (an empty one is ignored until filled in)."""
        self._rules.append(_Rule(pattern, axes, self._changed, self._remove))
        self._rules_box.children = [r.box for r in self._rules]
        if pattern or axes:
            self._changed()

    def _remove(self, rule: _Rule) -> None:
        self._rules.remove(rule)
        self._rules_box.children = [r.box for r in self._rules]
        self._changed()

    def _changed(self) -> None:
        if not self._quiet:
            self._on_edit()
