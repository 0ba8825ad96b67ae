"""The LayoutAdvisor's pinned axes and recipe files: axis sizes every layout keeps (``Constraints.fixed``, typed as
``tp=8 x pp=2``), a torchtitan TOML or MaxText YAML read in (its batch and mesh set the inputs and pins, and its own
plan is found among the rows, or said why not and priced alone) and the chosen row written out as one.

A mixin of :class:`~workbench.widgets.layout_advisor.LayoutAdvisor`: it reads the advisor's model, cluster, inputs
and chosen row.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import ipywidgets as widgets

from workbench.core.advisor.candidate import train_plan_text
from workbench.core.interop.maxtext import from_maxtext, to_maxtext
from workbench.core.interop.recipe import TrainingRecipe, recipe_of
from workbench.core.interop.torchtitan import from_torchtitan, to_torchtitan
from workbench.core.mesh import MESH_AXES
from workbench.core.plan import program_text
from workbench.core.units import format_seconds
from workbench.widgets._cluster_html import mesh_label, parse_mesh_label
from workbench.widgets._html import escape

__all__ = ["RECIPE_FORMATS", "RecipeControls", "parse_pins", "pins_text"]

# format name -> (reader, writer): the recipe box reads and writes one of these
RECIPE_FORMATS: dict[str, tuple[tp.Callable[..., TrainingRecipe], tp.Callable[[TrainingRecipe], str]]] = {
    "torchtitan TOML": (from_torchtitan, to_torchtitan),
    "MaxText YAML": (from_maxtext, to_maxtext),
}
_PANEL = "font-size:12px;line-height:1.4"  # the panel under the table (ipywidgets' HTML sets a 28 px line)


def pins_text(fixed: tp.Mapping[str, int]) -> str:
    """``{"tp": 8, "pp": 1}`` -> ``"pp=1 x tp=8"`` (mesh order; a pinned size of 1 is kept: it rules the axis out)."""
    return " x ".join(f"{a}={int(fixed[a])}" for a in MESH_AXES if a in fixed)


def parse_pins(text: str) -> dict[str, int]:
    """The inverse of :func:`pins_text` (``""``: nothing pinned); a ValueError that shows the form."""
    text = text.strip()
    if not text:
        return {}
    try:
        pins = parse_mesh_label(text)
    except ValueError:
        raise ValueError(f"{text!r}: write the pins as 'tp=8 x pp=2', each one of {MESH_AXES} once with a size of "
                         f"1 or more (empty: none pinned)") from None
    if any(n < 1 for n in pins.values()):
        raise ValueError(f"{text!r}: sizes are 1 or more (1 rules the axis out)")
    return pins


def same_plan(candidate: tp.Any, recipe: TrainingRecipe) -> bool:
    """Whether an advisor row runs ``recipe``'s step: its mesh, remat policy, pipeline, ZeRO stage (as a Layout
    takes it) and accumulation."""
    return (candidate.mesh_shape == dict(recipe.mesh_shape) and candidate.remat == recipe.remat
            and candidate.pipeline == recipe.pipeline and candidate.zero_stage == recipe.workbench_zero_stage
            and candidate.grad_accumulation == recipe.grad_accumulation)


def plan_label(recipe: TrainingRecipe) -> str:
    """A recipe's plan in the words of an advisor row's label (``Candidate.label``)."""
    return mesh_label(recipe.mesh_shape) + train_plan_text(recipe.remat, recipe.pipeline, recipe.grad_accumulation,
                                                           recipe.workbench_zero_stage)


class RecipeControls:
    """The pin box (``_pins``), the recipe box (``_recipe_text``) with its format, and the import and export
    buttons. ``advisor.recipe`` is the last recipe read in (None before)."""

    model: tp.Any
    cluster: tp.Any
    advice: tp.Any
    recipe: TrainingRecipe | None = None

    def _build_recipe(self, fixed: tp.Mapping[str, int]) -> list[widgets.Widget]:
        """The controls, the pins seeded from ``fixed``; the rows they sit in."""
        w = widgets
        self._pins = w.Text(pins_text(fixed), description="pin axes", placeholder="tp=8 x pp=2 (empty: none)",
                            continuous_update=False, style={"description_width": "58px"},
                            layout=w.Layout(width="280px"))
        self._pins.add_class("wb-advisor-pins")
        self._pins.observe(lambda _: self._quiet or self.pin(self._pins.value), names="value")
        self._format = w.Dropdown(options=list(RECIPE_FORMATS), description="recipe",
                                  style={"description_width": "46px"}, layout=w.Layout(width="200px"))
        self._import = w.Button(description="import recipe", icon="upload", layout=w.Layout(width="130px"))
        self._import.add_class("wb-advisor-import")
        self._export_recipe = w.Button(description="export row as recipe", icon="file-text-o",
                                       layout=w.Layout(width="170px"))
        self._export_recipe.add_class("wb-advisor-export-recipe")
        self._import.on_click(lambda _: self.import_recipe())
        self._export_recipe.on_click(lambda _: self.export_recipe())
        self._recipe_text = w.Textarea(placeholder="paste a torchtitan TOML or a MaxText YAML here and import it; "
                                                   "export writes the chosen row here",
                                       layout=w.Layout(width="100%", height="110px"))
        self._recipe_text.add_class("wb-advisor-recipe-text")
        return [w.HBox([self._pins, self._format, self._import, self._export_recipe]), self._recipe_text]

    # -- pins ----------------------------------------------------------------------------------------------------
    def pin(self, text: str) -> bool:
        """Pin the axes ``text`` names (:func:`parse_pins`) and re-rank; a bad text shows its error, stays in the box
        to be corrected, and the last pins stay in force."""
        with self._guard("pin axes", plain=(ValueError,)) as failed:
            pins = parse_pins(text)
        if failed:
            return False
        self._fixed = pins
        if self._pins.value != text:
            self._quiet = True  # a call from code shows in the box; rank once, here
            try:
                self._pins.value = text
            finally:
                self._quiet = False
        return self.rank()

    # -- recipe files --------------------------------------------------------------------------------------------
    def import_recipe(self, text: str | None = None, fmt: str | None = None) -> bool:
        """Read ``text`` (default: the recipe box) as ``fmt`` (default: the format chosen), for this cluster's
        devices and this model's layers; set the task to train, the batch and sequence length to the recipe's, and
        pin its mesh; re-rank and choose the recipe's own row, or say why it is not one (and price it alone when the
        step model can)."""
        fmt = self._format.value if fmt is None else fmt
        text = self._recipe_text.value if text is None else text
        with self._guard("import recipe", plain=(ValueError, TypeError, KeyError), clear="own") as failed:
            if fmt not in RECIPE_FORMATS:
                raise ValueError(f"the recipe format is one of {list(RECIPE_FORMATS)}; got {fmt!r}")
            if not text.strip():
                raise ValueError(f"the recipe box is empty: paste a {fmt} there, then import it")
            recipe = RECIPE_FORMATS[fmt][0](text, num_devices=self.cluster.num_devices, num_layers=self._layers())
            recipe.check_cluster(self.cluster)
        if failed:
            return False
        self.recipe = recipe
        seqs, length = recipe.batch
        self._quiet = True
        try:
            self._task.value = "train"
            self._show_task("train")
            self._tokens.value, self._seq.value = seqs * length, length
            self._pipeline.value = recipe.pipeline is not None or self._pipeline.value
            self._zero.value = bool(recipe.workbench_zero_stage) or self._zero.value
            self._fixed = {a: n for a, n in recipe.mesh_shape.items() if n > 1}  # the rest are 1: same devices
            self._pins.value = pins_text(self._fixed)
            # the recipe's program (its attention kernel, vocabulary tiles, offload, sequence parallelism) is what
            # every row of the re-ranking runs: the framework's, not the workbench's own
            self._given = dataclasses.replace(self._given, **recipe.program)
        finally:
            self._quiet = False
        if not self.rank():
            return False
        with self._guard("import recipe", plain=(ValueError, TypeError), clear="own") as failed:
            self._out.value = self._recipe_found_html(recipe)
        return not failed

    def _layers(self) -> int | None:
        """The layers a pipeline of this advisor's model splits (what a recipe's stages per rank are counted in)."""
        config = getattr(self.model, "config", self.model)
        layers = getattr(config, "num_hidden_layers", None)
        return None if layers is None else layers - getattr(config, "first_dense_layers", 0)

    def _recipe_found_html(self, recipe: TrainingRecipe) -> str:
        """Where the recipe's own plan landed: its rank among the pinned mesh's rows (chosen), the reason it does
        not fit, or why the advisor did not weigh it and its step priced alone."""
        ranked, rejected = self.advice.ranked, self.advice.rejected
        rank = next((i for i, c in enumerate(ranked, 1) if same_plan(c, recipe)), None)
        miss = next((c for c in rejected if same_plan(c, recipe)), None)
        what = f"the recipe's plan ({plan_label(recipe)})"
        if rank is not None and rank <= self.top:
            self._row.value = rank
            found = f"{what} ranks {rank} of {len(ranked)} with these pins: row {rank}, chosen below."
        elif rank is not None:
            found = f"{what} ranks {rank} of {len(ranked)} with these pins (the table lists the top {self.top})."
        elif miss is not None:
            found = f"{what}: {miss.reason.rstrip('.')}."
        else:
            why = "uneven pipeline stages only where no schedule divides the layers" \
                if recipe.pipeline is not None and recipe.pipeline.uneven else \
                "the least recompute that fits, accumulation only where a layout does not fit without it, and its " \
                "own pipeline schedules and microbatch counts"
            found = f"the advisor does not weigh {what}: it tries {why}."
            if self.advice.task == "train" and not (recipe.pipeline is not None and recipe.grad_accumulation > 1):
                step = recipe.price(self.model.config if hasattr(self.model, "config") else self.model, self.cluster)
                found += f" Priced alone by the same step model: {format_seconds(step.time_s)} a step."
        model = "" if recipe.model is None else \
            f" The recipe names the model {recipe.model}; the rows are this advisor's model."
        model += f" Every row runs the recipe's program: {program_text(recipe.program)}."
        notes = "".join(f"<li>{escape(n)}</li>" for n in recipe.notes)
        notes = f'<div>read as the workbench runs it:</div><ul style="margin:2px 0">{notes}</ul>' if notes else ""
        return (f'<div class="wb-advisor-recipe" style="{_PANEL}"><div class="wb-advisor-recipe-found">'
                f"{escape(found + model)}</div>{notes}</div>")

    def export_recipe(self, fmt: str | None = None) -> str | None:
        """The chosen row as a recipe file in ``fmt`` (default: the format chosen), written into the recipe box
        (importing it reads the same plan back); its model name is the last imported recipe's."""
        fmt = self._format.value if fmt is None else fmt
        c = self.selected()
        if c is None:
            return None
        with self._guard("export recipe", plain=(ValueError, TypeError), clear="own") as failed:
            if self.advice.task != "train":
                raise ValueError(f"a recipe file is a training run's; this row is a {self.advice.task} step: "
                                 f"switch the task to train")
            model = None if self.recipe is None else self.recipe.model
            recipe = recipe_of(c.layout(self.model), self.advice.batch, model=model, program=c.plan.program())
            text = RECIPE_FORMATS[fmt][1](recipe)
        if failed:
            return None
        self._recipe_text.value = text
        self._out.value = (f'<div class="wb-advisor-recipe" style="{_PANEL}">{escape(c.label)}: written as a '
                           f"{escape(fmt)} in the recipe box above (import it to read the same plan back).</div>")
        return text
