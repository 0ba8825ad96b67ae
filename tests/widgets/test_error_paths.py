"""Every widget error goes through one path (``workbench.widgets._errors``): each widget driven to a bad value, or
with the core call it makes monkeypatched to raise, says why in ``widget.error`` and in its inline error area, and
works again after a good value. Last, a scan of the widgets' source holds them to the one path."""

import ast
import html
import pathlib
import types

import jax
import pytest
from jax.sharding import PartitionSpec as P

import workbench.widgets
from workbench.core.advisor import Advice, Candidate
from workbench.core.cost import ledger as ledgers
from workbench.core.hardware.cluster import Cluster
from workbench.core.mesh import make_mesh
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import tiny, tiny_config
from workbench.core.views import explore, explore_step
from workbench.widgets import attention_lab as attention_lab_module
from workbench.widgets import pipeline_view as pipeline_view_module
from workbench.widgets import sharding_explorer as sharding_explorer_module
from workbench.widgets._errors import InlineError
from workbench.widgets.attention_lab import AttentionLab
from workbench.widgets.generation_view import GenerationView
from workbench.widgets.layout_advisor import LayoutAdvisor
from workbench.widgets.mesh_view import MeshView
from workbench.widgets.module_tree import ModuleTree
from workbench.widgets.pipeline_view import PipelineView
from workbench.widgets.sharding_explorer import ShardingExplorer
from workbench.widgets.sharding_view import ShardingView

needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 simulated devices")


def raises(error: BaseException):
    def call(*args, **kwargs):
        raise error

    return call


def shown(widget: InlineError, *parts: str) -> None:
    """``widget.error`` holds each of ``parts`` and the inline area shows the same text, escaped."""
    assert widget.error, "no inline error"
    for part in parts:
        assert part in widget.error, (part, widget.error)
    area = widget._error.value
    assert 'class="wb-error"' in area and html.escape(widget.error, quote=True) in area, area


def cleared(widget: InlineError) -> None:
    assert widget.error == "" and "wb-error" not in widget._error.value, widget.error


@pytest.fixture(scope="module")
def lazy_llama():
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama")))


# -- PipelineView ------------------------------------------------------------------------------------------------
def test_pipeline_view_schedule_and_compile_errors(monkeypatch):
    view = PipelineView(4, 8, "interleaved", model=types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=8)))
    cleared(view)
    view.microbatches.value = 2  # interleaved needs m to be a multiple of p
    shown(view, "ValueError: ", "multiple of num_stages=4")
    assert view.schedule is None and view.timeline.value == "" and view._error in view.widget.children
    assert view._repr_html_().startswith('<div class="wb-error"')
    view.microbatches.value = 8
    cleared(view)
    assert view.schedule is not None and "wb-pp-cell" in view.timeline.value

    monkeypatch.setattr(pipeline_view_module, "collectives_html", raises(RuntimeError("no <pp> mesh")))
    view.compile_button.click()  # the callback must not raise
    shown(view, "compile: RuntimeError: no <pp> mesh")
    assert view.collectives.value == ""
    monkeypatch.setattr(pipeline_view_module, "collectives_html", lambda *a: "<b>2 collectives</b>")
    assert view.compile()
    cleared(view)
    assert view.collectives.value == "<b>2 collectives</b>"


# -- MeshView and ShardingView -------------------------------------------------------------------------------------
@needs_8
def test_mesh_view_bad_sizes_and_a_failing_follower():
    view = MeshView(make_mesh(dp=2, fsdp=2, tp=2))
    assert not view.set_sizes(qq=2)
    shown(view, "invalid mesh shape: unknown axes ['qq']")
    assert view.set_sizes(dp=4, tp=2)
    cleared(view)

    calls = []

    def follower(mesh):
        calls.append(dict(mesh.shape))
        if len(calls) == 1:
            raise RuntimeError("follower <bug>")

    view.on_change(follower)
    assert view.apply()  # applied: only the follower failed
    shown(view, "mesh applied, but a follower failed: ", "follower: RuntimeError: follower <bug>")
    assert dict(view.mesh.shape)["dp"] == 4
    assert view.set_sizes(dp=2, tp=4) and view.apply()
    cleared(view)
    assert len(calls) == 2


@needs_8
def test_sharding_view_bad_spec_and_a_failing_follower():
    mesh = make_mesh(dp=2, fsdp=2, tp=2)
    view = ShardingView(((8, 16), "float32", P("fsdp", "tp")), mesh)
    assert not view.set_spec("fsdp, qq")
    shown(view, "spec not applied: ", "still showing")
    view.on_change(raises(RuntimeError("boom")))
    assert view.set_spec("tp, fsdp")  # shown; the follower's failure is said
    shown(view, "layout shown, but a follower failed: RuntimeError: boom")
    view._callbacks.clear()
    assert view.set_spec("fsdp, tp")
    cleared(view)


# -- ModuleTree and the experts panel ----------------------------------------------------------------------------
@needs_8
def test_module_tree_treescope_choice_and_experts_errors(monkeypatch):
    import treescope

    monkeypatch.setattr(treescope, "render_to_html", raises(RuntimeError("no <picture>")))
    tree = ModuleTree(tiny("llama", num_hidden_layers=2), mesh=make_mesh(dp=2, fsdp=2, tp=2))
    shown(tree, "treescope could not render this model: RuntimeError: no <picture>")
    assert tree._tree.outputs == ()
    tree._choose.value = "lm_head/kernel"  # a choice's own errors only: the tree's stays said
    shown(tree, "treescope could not render this model")
    tree._layer.value = 1
    shown(tree, "cannot render layer 1: RuntimeError: no <picture>")
    monkeypatch.undo()
    tree._layer.value = 0
    cleared(tree)
    assert tree._layer_tree.outputs and not tree.select("q_proj")
    shown(tree, "no parameter 'q_proj'")
    assert tree.select("")
    cleared(tree)


@needs_8
def test_the_experts_panel_errors_are_its_owners(monkeypatch):
    moe = tiny("mixtral")
    tree = ModuleTree(moe)  # not on a mesh: the panel's compute raises ValueError
    tree.experts.button.click()
    shown(tree, "experts: the model is not on a mesh: pass mesh=")
    assert "press" in tree.experts.out.value  # the panel shows what it showed before
    # the explorer's panel: the core call it makes raises
    ex = ShardingExplorer(CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("mixtral"))),
                          make_mesh(dp=2, fsdp=1, ep=4))
    monkeypatch.setattr(sharding_explorer_module, "expert_parallel_summary", raises(RuntimeError("dispatch <bug>")))
    assert not ex.compute_experts()
    shown(ex, "experts: RuntimeError: dispatch <bug>")
    assert ex.experts is None
    monkeypatch.undo()
    ex._filter.value = "q_proj"  # another panel's success leaves the experts' error said
    shown(ex, "experts: RuntimeError")
    assert ex.compute_experts()
    cleared(ex)
    assert ex.experts is not None and "all-to-alls" in ex._experts_out.value


# -- ShardingExplorer --------------------------------------------------------------------------------------------
@needs_8
def test_explorer_panels_say_their_errors_inline(monkeypatch, lazy_llama):
    ex = ShardingExplorer(lazy_llama, make_mesh(dp=2, fsdp=2, tp=2))
    cleared(ex)
    table = ex._table.value
    ex._filter.value = "q_proj(["  # not a regex: the last table stays
    shown(ex, "filter: 'q_proj([' is not a regex: ")
    assert ex._table.value == table
    ex._filter.value = "q_proj"
    cleared(ex)
    assert ex._table.value != table and "q_proj" in ex._table.value

    monkeypatch.setattr(explore.Layout, "to_code", raises(ValueError("no <code> for this")))
    ex._export_button.click()
    shown(ex, "export: no <code> for this")
    assert ex._export_out.value == ""
    monkeypatch.undo()
    assert ex.show_export()
    cleared(ex)
    assert 'class="wb-export"' in ex._export_out.value

    prompt = ex._collectives_out.value
    monkeypatch.setattr(explore, "step_collectives", raises(ValueError("cannot <compile>")))
    ex._collectives_button.click()
    shown(ex, "collectives: cannot <compile>")
    assert ex._collectives_out.value == prompt and ex.collectives is None
    monkeypatch.undo()

    monkeypatch.setattr(explore, "apply", raises(TypeError("no arrays")))
    assert ex.apply() is None
    shown(ex, "apply: no arrays")
    monkeypatch.undo()
    ex.editor.add_rule("embed_tokens", "TP, EMBD")  # a bad edit: the last valid layout stays
    shown(ex, "Did you mean EMBED", "still showing the last valid layout")
    ex.editor._rules[-1].axes.value = "VOCAB, EMBED"
    cleared(ex)
    assert ex.compute_collectives()
    cleared(ex)
    assert ex.collectives is not None


@needs_8
def test_explorer_on_a_cluster_ledger_and_predicted_step_errors(monkeypatch, lazy_llama):
    ex = ShardingExplorer(lazy_llama, cluster=Cluster.h100(nodes=2, gpus_per_node=4))
    cleared(ex)
    assert ex._ledger_out.value
    monkeypatch.setattr(ledgers, "ledger", raises(ValueError("no <ledger>")))
    ex._batch_b.value = ex._batch_b.value * 2
    shown(ex, "ledger: no <ledger>")
    assert ex._ledger_out.value == ""
    monkeypatch.undo()
    ex._batch_b.value = ex._batch_b.value // 2
    cleared(ex)
    assert ex._ledger_out.value

    monkeypatch.setattr(explore_step, "price", raises(ValueError("no <prediction>")))
    ex._task.value = "prefill"
    shown(ex, "predicted step: no <prediction>")
    assert ex._predicted_out.value == ""
    monkeypatch.undo()
    ex._task.value = "train"
    cleared(ex)
    assert ex._predicted_out.value


# -- LayoutAdvisor -----------------------------------------------------------------------------------------------
@needs_8
def test_layout_advisor_rank_confirm_open_and_export_errors(monkeypatch, lazy_llama):
    advisor = LayoutAdvisor(lazy_llama, Cluster.h100(nodes=1), batch_tokens=256, seq_len=32)
    cleared(advisor)
    table = advisor._table.value
    advisor._tokens.value = 100  # not a whole number of 32-token sequences: the last ranking stays
    shown(advisor, "not a whole number of sequences")
    assert advisor._table.value == table
    advisor._row.value = advisor._row.options[-1][1]  # a row change re-draws the table, the error stays said
    shown(advisor, "not a whole number of sequences")
    advisor._tokens.value = 256
    cleared(advisor)

    monkeypatch.setattr(Advice, "confirm_one", raises(RuntimeError("compiler <gone>")))
    advisor._confirm.click()
    shown(advisor, "confirm: RuntimeError: compiler <gone>")
    assert advisor._out.value == ""
    monkeypatch.setattr(Candidate, "layout", raises(ValueError("no <layout>")))
    assert advisor.export() is None
    shown(advisor, "export: no <layout>")
    monkeypatch.undo()
    code, _ = advisor.export()
    assert code.startswith("# workbench layout") and "wb-export" in advisor._out.value
    cleared(advisor)  # export cleared its own error

    monkeypatch.setattr(Advice, "confirm_one", raises(RuntimeError("compiler <gone>")))
    assert not advisor.confirm()
    assert advisor.export() is not None
    shown(advisor, "confirm: RuntimeError")  # another action's success leaves confirm's error said
    monkeypatch.setattr(Advice, "confirm_one", lambda self, c: None)
    assert advisor.confirm()
    cleared(advisor)
    monkeypatch.undo()

    monkeypatch.setattr(ShardingExplorer, "__init__", raises(ValueError("no <explorer>")))
    assert not advisor.open_in_explorer()
    shown(advisor, "open in explorer: no <explorer>")
    monkeypatch.undo()
    assert advisor.open_in_explorer()
    cleared(advisor)
    assert advisor.explorer is not None


# -- AttentionLab ------------------------------------------------------------------------------------------------
def test_attention_lab_bad_option_and_a_failing_comparison(monkeypatch):
    lab = AttentionLab(seq_len=64, gqa_ratio=4, runs=1)
    cleared(lab)
    assert not lab.set_options(dtype="float64")
    shown(lab, "dtype must be one of float32, bfloat16, float16; got 'float64'")
    monkeypatch.setattr(attention_lab_module, "compare", raises(RuntimeError("kernel <crashed>")))
    assert not lab.update()
    shown(lab, "RuntimeError: kernel <crashed>")
    assert lab.comparison is not None  # the last valid results stay
    monkeypatch.undo()
    assert lab.set_options(dtype="float32")
    cleared(lab)


# -- GenerationView ----------------------------------------------------------------------------------------------
def test_generation_view_bad_length_and_a_failing_generate(monkeypatch):
    model = tiny("llama", num_hidden_layers=1)
    view = GenerationView(model, prompt="Hello", cache_length=32, refresh_s=0)
    view.stop_at_eos.value = False
    view.max_new_tokens.value = 64  # more than the cache holds
    assert view.generate() is None
    shown(view, "needs", "but the cache holds 32")
    view.max_new_tokens.value = 8
    monkeypatch.setattr(type(model), "generate", raises(RuntimeError("decode <failed>")))
    assert view.generate() is not None and view.wait(120)
    shown(view, "generation failed: RuntimeError: decode <failed>")
    assert not view.generate_button.disabled  # ready for the next run
    monkeypatch.undo()
    assert view.generate() is not None and view.wait(120)
    cleared(view)
    assert view.output is not None


# -- the one path, in the source ---------------------------------------------------------------------------------
WIDGETS = pathlib.Path(workbench.widgets.__file__).parent
HOME = "_errors.py"


def off_path(source: str) -> list[str]:
    """What in a widget module's ``source`` handles an error off the one path, as ``line: why``.

    The rule: an exception becomes a message on screen only in ``_errors.py`` (``Guard``, which
    ``InlineError._guard`` wraps and which sets ``widget.error`` and the inline area). Elsewhere in
    ``workbench/widgets``:
      - every ``except`` handler ends in ``raise`` (re-raised, or translated into a clearer error that the guard
        up the call shows): a handler that ends any other way shows the error elsewhere or swallows it;
      - no ``contextlib.suppress`` (swallowing without a handler);
      - no ``print``, ``traceback.print_*`` or ``sys.stderr`` (the message printed somewhere else);
      - ``error_message`` (the exception as text) is called only in ``_errors.py``.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler):
            if not node.body or not isinstance(node.body[-1], ast.Raise):
                found.append(f"{node.lineno}: an except handler that does not end in raise (use self._guard)")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if name == "suppress":
                found.append(f"{node.lineno}: contextlib.suppress swallows errors")
            elif name == "print" or (owner == "traceback" and name.startswith("print")):
                found.append(f"{node.lineno}: {owner + '.' if owner else ''}{name} prints instead of the inline error")
            elif name == "error_message":
                found.append(f"{node.lineno}: error_message outside _errors.py (use self._guard)")
        elif isinstance(node, ast.Attribute) and node.attr == "stderr":
            found.append(f"{node.lineno}: sys.stderr instead of the inline error")
    return found


def test_the_scan_finds_what_it_forbids():
    bad = """
import contextlib, sys, traceback
try:
    f()
except ValueError as e:
    area.value = error_html(str(e))
try:
    f()
except Exception:
    pass
try:
    f()
except KeyError:
    raise ValueError("clearer") from None
with contextlib.suppress(OSError):
    f()
print("failed")
traceback.print_exc()
sys.stderr.write("x")
text = error_message(e)
"""
    lines = sorted(int(line.split(":")[0]) for line in off_path(bad))
    assert lines == [5, 9, 15, 17, 18, 19, 20], off_path(bad)


def test_every_widget_error_goes_through_the_one_path():
    modules = sorted(p for p in WIDGETS.glob("*.py") if p.name != HOME)
    assert len(modules) > 10
    problems = [f"{p.name}:{line}" for p in modules for line in off_path(p.read_text())]
    assert problems == [], "\n".join(problems)
