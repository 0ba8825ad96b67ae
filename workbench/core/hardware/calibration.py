"""What real kernels reach on each chip: the efficiency constants of the step model, each with its evidence.

Every number :func:`~workbench.core.cost.predicted.predict_step` prices a step with, beyond the datasheet peaks
of :mod:`~workbench.core.hardware.chips`, lives here, as an :class:`Evidence`: its value and where it was measured
(a repository, file and revision; a paper's table), or, where no measurement could be found, the words
"not sourced" and what the value was fitted to. ``tests/core/hardware/test_calibration.py`` reproduces each cited
measurement from the model within the tolerance stated beside it.

The mechanisms (:mod:`workbench.core.cost.kernels` prices them):

- **GEMMs** reach ``gemm`` of the dense peak when every dimension is large; the MXU / tensor-core ``tile``
  pads each dimension to a multiple of it; a contraction ``K`` fills the unit's pipeline as ``K / (K + k_half)``
  (relative to ``K = 4096``), and an output width ``N`` below ``n_full`` leaves part of the unit idle
  (the rate falls in proportion); few rows only pad to the tile (a decode GEMM is bound by reading its weights).
- **Flash attention** (cuDNN, FlashAttention, TPU splash) reaches ``attention`` of the peak as the sequence grows
  (at ``head_dim`` 128), counting only the FLOPs of the tiles the causal mask keeps (the kernel skips the
  rest); shorter sequences and narrower heads lose ``T / (T + t_half)`` and ``D / (D + d_half)`` (per tile
  setup amortised over the row and the head). A named kernel with a rate of its own (``attention_kernels``,
  keyed by :data:`~workbench.core.vocab.ATTENTION_KERNELS`' names) reaches that rate instead, with the same
  ``t_half`` and ``d_half``.
- **Memory-bound fusions** (norms, RoPE, activations, residual adds, casts, the loss, the optimizer update)
  move their bytes at ``hbm`` of the HBM bandwidth; ``fusion`` is the HBM traffic the compiler's fusions
  really move over the minimal count of the step model (inputs read once, outputs written once).
- **Collectives** reach ``network`` of the links' bandwidth (the bus bandwidth NCCL / XLA collectives attain).
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing as tp

from workbench.core.hardware.chips import (
    B200,
    GB200,
    H100,
    H100_500W,
    H200,
    TPU7X,
    TPU_V4,
    TPU_V5E,
    TPU_V5P,
    TPU_V6E,
    Hardware,
)

H100_MEASURED = ("benchmarks/data/h100_measured_2026-11-27.json in this repository (benchmarks/gpu_constants.py "
                 "on one H100 SXM 80GB, JAX 0.11.2, CUDA 13; commit fd0b56c)")


@dataclasses.dataclass(frozen=True)
class Evidence:
    """A constant and where it comes from: ``source`` names the measurement (or says "not sourced")."""

    value: float
    source: str

    @property
    def sourced(self) -> bool:
        return not self.source.startswith("not sourced")


@dataclasses.dataclass(frozen=True)
class ChipCalibration:
    """The efficiencies one chip's kernels reach (see the module doc for each mechanism)."""

    chip: str
    gemm: Evidence
    tile: int
    k_half: float
    n_full: float
    attention: Evidence
    attention_t_half: float
    attention_d_half: float
    hbm: Evidence
    fusion: Evidence
    network: Evidence
    gemm_fp8: Evidence | None = None
    # a kernel's own long-sequence rate where it is not the chip's production one (``attention``)
    attention_kernels: tp.Mapping[str, Evidence] = dataclasses.field(default_factory=dict, hash=False)


_POWER_500W = (500 / 700) ** (1 / 3)
_H100 = ChipCalibration(
    chip="H100 SXM",
    gemm=Evidence(0.70, f"{H100_MEASURED}: bf16 GEMMs 4096^3 to 16384^3 and the projections of Llama-3.2-1B and "
                        f"Llama-3-8B on 8,192 tokens (fwd, dx, dw) reach 601 to 757 TFLOP/s, median 672: 0.68 of "
                        f"989; within one step on trained-scale weights the same GEMMs reach 780 (the profile in "
                        f"benchmarks/data/README.md). 0.70 reproduces every large shape within 20 % (the 1B head's "
                        f"forward, 534, is the farthest)."),
    # fitted to the same file's skinny-K / skinny-N GEMMs (M 8192), each within 25 %
    tile=64, k_half=220.0, n_full=512.0,
    attention=Evidence(0.59, f"{H100_MEASURED}: cuDNN flash attention, causal, fwd+bwd (backward 2.5x the "
                             f"forward), D=128: 344 / 497 / 562 TFLOP/s at T = 2,048 / 8,192 / 16,384; D=64: 266 / "
                             f"336 at 2,048 / 4,096. Fitted: 0.59 x T/(T+1427) x (D/(D+54)) / (128/(128+54)), "
                             f"within 5 % of each."),
    attention_t_half=1427.0, attention_d_half=54.0,
    hbm=Evidence(0.87, f"{H100_MEASURED}: copy 2.93 TB/s, read-only sum 3.10, RMSNorm 2.65, AdamW f32 update 2.95, "
                       f"of 3.35 (0.79 to 0.93)."),
    fusion=Evidence(2.0, f"{H100_MEASURED}, the profiled Llama-3.2-1B train step: its non-GEMM, non-attention "
                         f"kernels (fusions and the layer scan's copies, 69.5 ms of 161) move about twice the "
                         f"minimal traffic this model counts for them at 0.87 of the HBM bandwidth."),
    network=Evidence(0.80, "not sourced: NCCL's bus bandwidth on NVLink 4 / InfiniBand NDR is commonly 75-85 % of "
                           "the links' (nccl-tests); chosen, not fitted."),
    gemm_fp8=Evidence(0.55, "not sourced: fp8 GEMMs on H100 reach about 55 % of the 1,979 TFLOP/s fp8 peak in "
                            "torchtitan's float8 runs; the per-tensor scaling casts are priced as fusions."),
    attention_kernels={"flash_triton": Evidence(
        0.19, "not sourced: derived from two of llm-foundry's seventeen MPT runs at 8,192-65,536 tokens on 8 "
              "H100s (attn_impl 'triton': Tri Dao's flash_attn_triton.py on triton-pre-mlir). MPT-7B's "
              "1,048,576-token steps take 39.49 s at 32,768 tokens a sequence and 66.98 s at 65,536, the same "
              "matmuls, so the 27.49 s between them is attention's extra 4.05e16 causal FLOPs (forward, backward, "
              "recompute: 4.5 x 2 T d L a token) over 8 GPUs: 184 TFLOP/s, 0.186 of 989, shipped as 0.19. The other "
              "fifteen (MPT-760M to 30B) come out 0.73-1.04x at it; fitted to all seventeen it would be 0.183 "
              "(benchmarks/published_runs.py refits it without each run).")},
)

# TPU constants: no standalone TPU kernel measurement could be run here or found published with its shapes, so
# the TPU values are fitted to MaxText's published runs (benchmarks/published_runs.py lists them and which ones
# the fit used); each says so.
_TPU_FIT = "not sourced: fitted to MaxText's published runs on this chip (benchmarks/published_runs.py)"


def _tpu(chip: str, gemm: float, tile: int, attention: float, hbm: float, fusion: float, network: float
         ) -> ChipCalibration:
    return ChipCalibration(
        chip=chip, gemm=Evidence(gemm, f"{_TPU_FIT}; the MXU's {tile}x{tile} tiles"), tile=tile,
        k_half=220.0, n_full=float(tile),
        attention=Evidence(attention, f"{_TPU_FIT}; splash attention skips masked blocks"),
        attention_t_half=1427.0, attention_d_half=54.0,
        hbm=Evidence(hbm, f"{_TPU_FIT}"), fusion=Evidence(fusion, f"{_TPU_FIT}: XLA:TPU fuses elementwise work into "
                                                             f"the matmuls' prologues and epilogues"),
        network=Evidence(network, f"{_TPU_FIT}"))


def carried_over(cal: ChipCalibration, chip: str, reason: str) -> ChipCalibration:
    """``cal``'s constants for ``chip``, each saying it was carried over from ``cal.chip`` (``reason``: why that
    chip's), never measured on ``chip``: what a chip without a measurement or a fit of its own is priced with."""
    def carried(e: Evidence) -> Evidence:
        return Evidence(e.value, f"not sourced: {cal.chip}'s {e.value}, carried over ({reason}); {cal.chip}'s "
                                 f"evidence: {e.source}")
    efficiencies = {f.name: carried(getattr(cal, f.name)) for f in dataclasses.fields(ChipCalibration)
                    if f.type.startswith("Evidence") and getattr(cal, f.name) is not None}
    return dataclasses.replace(cal, chip=chip, **efficiencies,
                               attention_kernels={k: carried(e) for k, e in cal.attention_kernels.items()})


_V6E = _tpu("TPU v6e", 0.66, 256, 0.55, 0.85, 1.0, 0.80)
_BLACKWELL = "the Hopper GPU a generation before, with no Blackwell measurement at hand"
# keyed by the chip itself (a Hardware), never by its name: renaming a chip cannot unlink its calibration
CALIBRATIONS: dict[Hardware, ChipCalibration] = {
    H100: _H100,
    H200: dataclasses.replace(_H100, chip="H200 SXM"),  # the same SMs and NVLink; HBM from the datasheet
    # 500 W instead of 700: the clock a power cap leaves, if power goes as the cube of the clock near the top of
    # the voltage-frequency curve, is (500 / 700) ** (1 / 3) = 0.89 of it; not measured.
    H100_500W: dataclasses.replace(
        _H100, chip="H100 96GB HBM2e 500 W",
        gemm=Evidence(round(0.70 * _POWER_500W, 3), "not sourced: the H100 SXM's measured 0.70 times (500/700)^(1/3)"),
        attention=Evidence(round(0.59 * _POWER_500W, 3), "not sourced: the H100 SXM's 0.59 times (500/700)^(1/3)"),
        attention_kernels={name: Evidence(round(e.value * _POWER_500W, 3), f"not sourced: the H100 SXM's "
                                                                          f"{e.value} times (500/700)^(1/3)")
                           for name, e in _H100.attention_kernels.items()}),
    TPU_V4: _tpu("TPU v4", 0.80, 128, 0.55, 0.85, 1.0, 0.80),
    TPU_V5E: _tpu("TPU v5e", 0.80, 128, 0.55, 0.85, 1.0, 0.80),
    TPU_V5P: _tpu("TPU v5p", 0.85, 128, 0.55, 0.85, 1.0, 0.80),
    TPU_V6E: _V6E,
    TPU7X: carried_over(_V6E, "TPU7x (Ironwood)", "the TPU a generation before, with 256x256 MXUs as Ironwood's"),
    B200: carried_over(_H100, "B200 (DGX / HGX)", _BLACKWELL),
    GB200: carried_over(_H100, "B200 in GB200 NVL72", _BLACKWELL),
}

# A serving engine's own cost a step, beyond the bytes and FLOPs the step model prices, in seconds a layer: the gaps
# between a layer's small kernels and their launches, the collectives' latency, the scheduler's and the sampler's
# time spread over the layers. A decode step of a small batch on an H100 shows it plainly: TensorRT-LLM's Llama-3.1-8B
# (32 layers) and Llama-3.1-70B (80 layers) steps both take about 80 us a layer more than reading their weights. Fitted
# per engine and chip to the measured decode steps of published_serving.json (the geometric mean of their
# predicted / measured at 1; benchmarks/published_serving.py refits each without every step in turn and prints both
# spreads); an engine and chip with no measured decode step get no such term, and say so.
_SERVING_FIT = "not sourced: fitted to the measured decode steps of published_serving.json"
_TRT = Evidence(66e-6, f"{_SERVING_FIT}: TensorRT-LLM's 11 (TensorRT-LLM 0.14 on H100 and H200, NVIDIA NIM 1.8.0 "
                       f"on H100; Llama-3.1-8B and -70B, bf16 and fp8, 1 to 127 requests in flight)")
ENGINE_LAYER: dict[tuple[str, Hardware], Evidence] = {
    ("TensorRT-LLM", H100): _TRT,
    ("TensorRT-LLM", H200): _TRT,
    ("vLLM", TPU_V6E): Evidence(174e-6, f"{_SERVING_FIT}: vLLM's 6 on TPU v6e (Llama-3.3-70B on v6e-8, Qwen3-8B and "
                                        f"-32B on v6e-4; 8 to 128 requests in flight)"),
    ("sglang-jax", TPU_V6E): Evidence(113e-6, f"{_SERVING_FIT}: sglang-jax's 5 on TPU v6e-4 (Qwen3-8B and -32B, "
                                              f"Llama-3.1-8B; 8 to 64 requests in flight)"),
    ("sglang-jax", TPU7X): Evidence(234e-6, f"{_SERVING_FIT}: sglang-jax's 3 on TPU7x-4 (Qwen3-8B, Llama-3.3-70B, "
                                            f"Qwen3-30B-A3B; 128 requests in flight)"),
}


def engine_layer(engine: str, chip: Hardware) -> Evidence | None:
    """The per-layer cost a step of ``engine`` serving on ``chip`` (an :class:`Evidence` in seconds), or None where
    no measured decode step prices it."""
    return ENGINE_LAYER.get((engine, chip))


# Framework-level facts, each measured or counted elsewhere.
ADAMW_F32_BYTES = 28  # a parameter's AdamW update with f32 master weights and moments: read p, m, v, g; write p, m, v
FLASH_BACKWARD = 2.5  # a flash kernel's backward FLOPs over its forward's (recomputes the scores: 5 matmuls vs 2)


def calibration(chip: Hardware) -> ChipCalibration:
    """The calibration of ``chip`` (a :class:`~workbench.core.hardware.chips.Hardware`, e.g. ``cluster.chip``)."""
    if not isinstance(chip, Hardware):
        raise TypeError(f"calibration takes a chip (a workbench.core.hardware.chips.Hardware such as cluster.chip), "
                        f"not {type(chip).__name__} {chip!r}")
    if chip not in CALIBRATIONS:
        raise ValueError(f"no measured efficiencies for {chip.name!r}; calibrated chips: "
                         f"{sorted(c.name for c in CALIBRATIONS)}")
    return CALIBRATIONS[chip]


@contextlib.contextmanager
def overridden(chips: tp.Iterable[Hardware], field: str, value: float, source: str) -> tp.Iterator[None]:
    """Within the block, ``field`` of each chip's calibration is ``value`` (an :class:`Evidence` citing
    ``source``); restored after. ``field`` names an efficiency (``"gemm"``) or a kernel's own attention rate
    (``"attention_kernels.flash_triton"``). For refitting a constant (leave-one-out:
    :mod:`workbench.core.interop.out_of_sample`), never for shipping one: a shipped constant is edited here with
    its evidence."""
    name, _, kernel = field.partition(".")
    efficiencies = [f.name for f in dataclasses.fields(ChipCalibration) if f.type.startswith("Evidence")]
    if (name != "attention_kernels" or not kernel) and name not in efficiencies:
        raise ValueError(f"{field!r} is not an efficiency of ChipCalibration; one of {efficiencies}, or "
                         f"'attention_kernels.<kernel>'")
    saved = {chip: calibration(chip) for chip in chips}
    try:
        for chip, cal in saved.items():
            evidence = Evidence(value, source)
            change = ({name: {**cal.attention_kernels, kernel: evidence}} if name == "attention_kernels"
                      else {name: evidence})
            CALIBRATIONS[chip] = dataclasses.replace(cal, **change)
        yield
    finally:
        CALIBRATIONS.update(saved)


__all__ = ["ADAMW_F32_BYTES", "CALIBRATIONS", "ENGINE_LAYER", "FLASH_BACKWARD", "ChipCalibration", "Evidence",
           "calibration", "carried_over", "engine_layer", "overridden"]
