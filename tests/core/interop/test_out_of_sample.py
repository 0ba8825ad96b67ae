"""Leave-one-out over the published runs (workbench/core/interop/out_of_sample.py): the fit and the refits held
against closed forms on a step whose time is exactly inverse to the constant, and the real table's spread."""

import math

import numpy as np
import pytest

from workbench.core.hardware.calibration import calibration, overridden
from workbench.core.hardware.chips import H100, TPU_V6E
from workbench.core.interop.out_of_sample import FITTED, accuracy_text, fit, leave_one_out, out_of_sample
from workbench.core.interop.published import accuracy, published_runs

V6E_GEMM = next(c for c in FITTED if c.label == "TPU v6e gemm")
TRITON = next(c for c in FITTED if c.field == "attention_kernels.flash_triton")


def _v6e_runs():
    return [r for r in published_runs() if r.cluster.chip == TPU_V6E]


def _inverse_step(work: dict[str, float]):
    """A step of ``work[name] / gemm`` seconds: the geometric-mean fit has the closed form gm(work / measured)."""
    return lambda run: work[run.name] / calibration(run.cluster.chip).gemm.value


def test_the_fit_centres_its_runs_as_the_closed_form_does():
    runs = _v6e_runs()
    rng = np.random.default_rng(0)
    work = {r.name: r.measured_s * float(rng.uniform(0.3, 0.9)) for r in runs}
    expected = math.exp(np.mean([np.log(work[r.name] / r.measured_s) for r in runs], dtype=np.float64))
    assert fit(V6E_GEMM, runs, _inverse_step(work)) == pytest.approx(expected, rel=1e-6)


def test_a_step_partly_inverse_to_the_constant_is_centred_where_a_dense_grid_says():
    runs = _v6e_runs()
    fixed = {r.name: 0.2 * r.measured_s for r in runs}  # a part the constant does not scale
    work = {r.name: 0.5 * r.measured_s * (1 + i / 10) for i, r in enumerate(runs)}

    def seconds(run):
        return fixed[run.name] + work[run.name] / calibration(run.cluster.chip).gemm.value

    grid = np.linspace(0.3, 1.0, 700_001)
    mean_log = np.mean([np.log((fixed[r.name] + work[r.name] / grid) / r.measured_s) for r in runs], axis=0)
    assert fit(V6E_GEMM, runs, seconds) == pytest.approx(grid[np.argmin(np.abs(mean_log))], rel=1e-5)


def test_each_run_is_priced_with_the_constant_fitted_to_the_others():
    runs = _v6e_runs()
    work = {r.name: r.measured_s * (0.5 + 0.03 * i) for i, r in enumerate(runs)}
    loo = leave_one_out(runs, _inverse_step(work), constants=[V6E_GEMM])
    for r in runs:
        others = [o for o in runs if o is not r]
        refit = math.exp(np.mean([np.log(work[o.name] / o.measured_s) for o in others]))
        assert loo.refits[0].left_out[r.name] == pytest.approx(refit, rel=1e-6)
        assert loo.ratios[r.name] == pytest.approx(work[r.name] / refit / r.measured_s, rel=1e-6)


def test_the_shipped_constants_are_back_after_refitting():
    before = {c.label: c.shipped() for c in FITTED}
    leave_one_out(_v6e_runs()[:3])
    assert {c.label: c.shipped() for c in FITTED} == before
    with pytest.raises(ZeroDivisionError), overridden([TPU_V6E], "gemm", 0.5, "a test"):
        assert calibration(TPU_V6E).gemm.value == 0.5
        raise ZeroDivisionError
    assert calibration(TPU_V6E).gemm.value == before["TPU v6e gemm"]
    with pytest.raises(ValueError, match="not an efficiency"):
        with overridden([TPU_V6E], "tile", 64, "a test"):
            pass
    with overridden([H100], "attention_kernels.flash_triton", 0.5, "a test"):
        assert calibration(H100).attention_kernels["flash_triton"].value == 0.5
        assert calibration(H100).attention.value == 0.59  # the other rates stay
    assert calibration(H100).attention_kernels["flash_triton"].value == before[TRITON.label]


def test_the_triton_rate_is_fitted_to_the_runs_that_ran_that_kernel_only():
    mine = [r.name for r in published_runs() if TRITON.covers(r)]
    assert len(mine) == 17 and all(n.startswith("llmfoundry-") for n in mine)
    assert all(r.plan.attention == "flash_triton" for r in published_runs() if r.name in mine)


def test_out_of_sample_every_run_stays_in_the_band_and_unfitted_runs_keep_their_ratio():
    oos = out_of_sample()
    shipped = accuracy().ratios
    assert set(oos.ratios) == set(shipped)
    outside = {name: round(r, 3) for name, r in oos.ratios.items() if not 0.7 <= r <= 1.35}
    assert not outside
    unfitted = oos.unfitted()
    # the H100 bf16 runs (measured constants), and every run on a chip whose constants were carried over from
    # another's (TPU7x, B200, GB200): no constant was fitted to them
    carried = {r.name for r in published_runs() if "carried over" in calibration(r.cluster.chip).gemm.source}
    assert carried and carried <= set(unfitted)
    assert all(n.endswith("bf16") and "h100" in n for n in set(unfitted) - carried)
    for name in unfitted:
        assert oos.ratios[name] == shipped[name]
    assert {r.constant.label for r in oos.refits} == {c.label for c in FITTED}
    assert "out of sample" in accuracy_text() and f"on {len(shipped)} published training steps" in accuracy_text()
