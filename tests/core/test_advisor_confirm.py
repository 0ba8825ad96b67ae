"""Confirming a layout compares like with like (issue 48): a step of accumulated microbatches is confirmed by
compiling one microbatch (its own prediction and ledger beside it) and shown whole as that program times the
microbatches plus what the accumulation adds; a decode step is compiled with its KV cache. Each figure is held
against a reference the confirm code does not make: the compiled program's own memory analysis and matmul count,
the same step compiled directly, the microbatch count, the KV cache's bytes by hand; the rows against
``cost.reconcile``'s; the words against what a person reads (no exponents, no "0 ns" for work that exists)."""

import dataclasses
import importlib.util
import re

import jax.numpy as jnp
import pytest

from workbench.core.advisor import Confirmation, Constraints, advise
from workbench.core.compile.virtual import compile_step
from workbench.core.cost.ledger import ledger
from workbench.core.cost.price import price
from workbench.core.cost.reconcile import reconcile
from workbench.core.hardware.cluster import Cluster
from workbench.core.models import CausalLM, ModelConfig
from workbench.core.models.presets import full_config, tiny_config

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason='libtpu missing: pip install "jax-workbench[tpu-aot]" (make test does)')
EXPONENT = re.compile(r"\d[eE][+-]?\d")


def _tiny():
    """A float32 Llama (XLA:CPU keeps float32 as it is: its memory is comparable with the ledger's)."""
    return CausalLM.lazy_init(ModelConfig.from_hf(tiny_config("llama", hidden_size=256, intermediate_size=512,
                                                              num_hidden_layers=4)))


def _reads_as_a_person_does(confirmation: Confirmation) -> None:
    """No number in exponent notation, and no zero shown for work the compiled program has."""
    text = confirmation.table()
    assert not EXPONENT.search(text), text
    for cells, _ in confirmation.cells():
        assert not {"0 ns", "0 s", "0 B", "0 FLOP"} & set(cells), cells
    for r in confirmation.rows:
        if r.row.compiled and not r.row.predicted and r.row.held_in:
            assert r.row.predicted_text.startswith("in "), r.row


def _same_as_reconcile(rows, reference) -> None:
    assert [(r.quantity, r.predicted, r.compiled, r.unit, r.why) for r in rows] == \
        [(r.quantity, r.predicted, r.compiled, r.unit, r.why) for r in reference]


def test_a_step_of_microbatches_is_one_compiled_microbatch_times_their_count():
    """fsdp=8 on one 8-GPU node, 32 sequences of 128 in 4 microbatches: the compiled program is the train step of
    one microbatch (8 sequences), as compiling that step directly gives; its prediction is that step's, the step's
    column is the program times 4 plus what the accumulation adds."""
    model, cluster, batch = _tiny(), Cluster.h100(nodes=1), (32, 128)
    advice = advise(model, cluster, batch_tokens=batch[0] * batch[1], seq_len=batch[1],
                    constraints=Constraints(pipeline=False, fixed={"fsdp": 8}, grad_accumulation=(4,)))
    c = advice.confirm_one(advice.ranked[0])
    conf = c.confirmation
    assert c.grad_accumulation == conf.microbatches == 4
    # the program compiled is the one-microbatch train step: compiling it directly gives the same program
    direct = compile_step(model.with_options(remat=c.remat), cluster, c.mesh_shape, kind="train", batch=(8, 128),
                          partition_axis=c.partition_axis, rules=c.rules or None, zero_stage=c.zero_stage)
    assert direct.memory == c.compiled.memory and direct.matmul_flops == c.compiled.matmul_flops
    assert direct.collectives_summary() == c.compiled.collectives_summary()
    # its memory is XLA's buffer assignment; the step holds the gradients' running sum beside it
    memory = conf["memory: total"]
    assert memory.row.compiled == direct.memory.total
    assert conf["memory: arguments"].row.compiled == direct.memory.argument
    assert memory.accumulation == c.ledger.grads > 0 and memory.compiled_step == direct.memory.total + c.ledger.grads
    # the step runs the program's dots 4 times (accumulating adds no matmul)
    flops = conf["matmul FLOPs"]
    assert flops.row.compiled == direct.matmul_flops
    assert flops.compiled_step == pytest.approx(4 * direct.matmul_flops, rel=1e-9)
    # like with like: the program's prediction is the one-microbatch step's, its ledger that step's
    program = price(c.plan.replace(grad_accumulation=1), model, cluster, (8, 128), "train")
    held = ledger(model, c.layout(model), kind="train", batch=(8, 128), remat=c.remat, cluster=cluster)
    assert conf["step time"].row.predicted == program.time_s and conf["step time"].predicted_step == c.step.time_s
    assert held.total == c.ledger.total - c.ledger.grads == memory.row.predicted
    _same_as_reconcile([r.row for r in conf.rows],
                       reconcile(program, c.compiled_step, held, c.compiled, seq_len=128))
    whole = {r.quantity: r.predicted for r in reconcile(c.step, c.compiled_step, c.ledger, c.compiled, seq_len=128)}
    for r in conf.rows:
        assert r.predicted_step == whole[r.quantity]
        times = 1 if r.quantity.startswith("memory:") else 4
        assert r.accumulation == pytest.approx(r.predicted_step - times * r.row.predicted, abs=1e-12)
        assert r.compiled_step == pytest.approx(times * r.row.compiled + r.accumulation, abs=1e-12)
    # one optimizer update a step, not one a microbatch: the accumulation takes three updates' memory time away
    update = next(t.seconds for t in program.terms if t.name == "optimizer update")
    assert update > 0 and conf["memory time"].accumulation == pytest.approx(-3 * update, rel=0.02)
    assert "one train step of one microbatch: 8 of the step's 32 sequences" in conf.program
    assert conf.header[-1] == "compiled step (4 x microbatch + accumulation)"
    assert "for one of its 4 microbatches" in c.confirm_note
    _reads_as_a_person_does(conf)


def test_a_decode_step_is_compiled_with_its_kv_cache():
    """tp=4 x dp=2 on one 8-GPU node, 8 sequences against a 512-position cache: the compiled program is the decode
    step with the cache an argument, donated (aliased to its output), as compiling it directly gives; the row's
    ledger counts the same cache."""
    model, cluster = _tiny(), Cluster.h100(nodes=1)
    advice = advise(model, cluster, batch_tokens=8, seq_len=512, task="decode",
                    constraints=Constraints(fixed={"tp": 4, "dp": 2}))
    c = advice.confirm_one(advice.ranked[0])
    conf = c.confirmation
    assert conf.microbatches == 1 and conf.header == ("", "predicted", "compiled")
    direct = compile_step(model, cluster, c.mesh_shape, kind="decode", batch=(8, 1), kv_length=512,
                          partition_axis=c.partition_axis, rules=c.rules or None)
    assert direct.memory == c.compiled.memory and direct.collectives_summary() == c.compiled.collectives_summary()
    # one device's cache by hand: 4 layers x keys and values x 4 of the 8 rows (dp=2) x 512 positions x 1 of the
    # 2 KV heads stored 4 times over tp=4 (one per device) x 64 x float32
    cache = 4 * 2 * 4 * 512 * 1 * 64 * 4
    assert c.ledger.kv_cache == cache
    assert direct.memory.alias >= cache and direct.memory.argument >= cache + c.ledger.params
    arguments = conf["memory: arguments"]
    assert arguments.row.compiled == direct.memory.argument
    assert arguments.row.predicted == c.ledger.params + c.ledger.kv_cache + c.ledger.inputs
    assert arguments.row.compiled == pytest.approx(arguments.row.predicted, rel=0.02)
    assert conf["matmul FLOPs"].row.compiled == direct.matmul_flops
    _same_as_reconcile([r.row for r in conf.rows], reconcile(c.step, c.compiled_step, c.ledger, c.compiled,
                                                             seq_len=1))
    assert "KV cache of 512 positions" in conf.program and "a decode step with its KV cache" in c.confirm_note
    assert "without a cache" not in conf.program + c.confirm_note
    _reads_as_a_person_does(conf)


@needs_libtpu
def test_the_reviews_decode_row_compares_like_with_like():
    """Llama-3-70B decoding 8 sequences against an 8k cache with tp=16 on v5e:4x4, the row the review confirmed
    against a forward without a cache (memory 10.8 vs 8.23 GiB, predicted compute "0 ns"). Compiled with its cache
    the program holds the 2.5 GiB the ledger counts, moves about the bytes a decode step must read (the weights
    and the cache, once), and the prediction's zero compute says where its matmuls' time is."""
    model = CausalLM.lazy_init(full_config("llama-3-70b"), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    advice = advise(model, Cluster.tpu("v5e:4x4"), batch_tokens=8, seq_len=8192, task="decode")
    c = advice.confirm_one(advice.best)
    assert c.mesh_shape["tp"] == 16
    conf, memory = c.confirmation, c.compiled.memory
    cache = 80 * 2 * 8 * 8192 * 1 * 128 * 2  # layers, keys and values, rows, positions, one head a device, bf16
    assert c.ledger.kv_cache == cache and memory.alias >= cache
    assert memory.argument >= c.ledger.params + cache
    assert conf["memory: total"].row.compiled == memory.peak == memory.total  # XLA:TPU's peak_memory_in_bytes
    assert memory.total == pytest.approx(c.ledger.total, rel=0.05)
    # a decode step reads every weight and the whole cache once: the compiled bytes are about that, not a cache
    # read per layer for its one-token write (the in-place dynamic-update-slice)
    must_read = c.ledger.params + cache
    assert 0.9 * must_read < c.compiled.hbm_bytes < 1.3 * must_read
    compute = conf["compute time"]
    assert compute.row.predicted == 0 < compute.row.compiled and "matmuls bound by HBM" in compute.row.held_in
    assert compute.row.predicted_text.startswith("in matmuls bound by HBM (")
    assert 0.5 < conf["step time"].row.compiled / conf["step time"].row.predicted < 2
    _reads_as_a_person_does(conf)


def test_a_row_planned_with_production_s_program_is_held_against_the_program_compiled():
    """Planned with flash attention and sequence parallelism inside tp (``PRODUCTION``), a row compiles as the
    workbench's own program (its XLA attention, its residual stream whole over tp): the compiled memory is held
    against that program's ledger, the same one a row planned with the workbench's program would have, and the
    note says which program was compiled and which was ranked."""
    from workbench.core.plan import PRODUCTION

    model, cluster, batch = _tiny(), Cluster.h100(nodes=1), (16, 512)
    fixed = Constraints(pipeline=False, fixed={"fsdp": 4, "tp": 2}, grad_accumulation=(1,))
    planned = advise(model, cluster, batch_tokens=batch[0] * batch[1], seq_len=batch[1], remat="none",
                     constraints=dataclasses.replace(fixed, **PRODUCTION))
    own = advise(model, cluster, batch_tokens=batch[0] * batch[1], seq_len=batch[1], remat="none", constraints=fixed)
    c, same = planned.ranked[0], own.ranked[0]
    assert c.plan.program() == PRODUCTION and c.mesh_shape == same.mesh_shape
    assert c.ledger.total < same.ledger.total  # no scores saved, the residual stream split over tp
    c = planned.confirm_one(c)
    memory = c.confirmation["memory: total"]
    assert memory.row.predicted == same.ledger.total  # held against the workbench program's ledger
    assert "compiled as the workbench's program (xla attention" in c.confirm_note
    assert "not the ranked one (flash attention" in c.confirm_note
