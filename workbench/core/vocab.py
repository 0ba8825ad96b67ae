"""The words every layer shares: what a step does, the remat policies the ledger and the step model count, the
optimizers a step is built with. Each tuple is the one list of its choices; a check against it is in
:func:`workbench.core.checks.one_of`.
"""

TASKS = ("train", "prefill", "decode")
# the remat policies of models/stack.py that the ledger and the step model count
REMATS = ("none", "dots_saveable", "full")
OPTIMIZERS = ("adamw", "adafactor", "sgd")
# how a step's attention runs: "xla" materialises the scores (the workbench's own program), "flash" tiles them in
# on-chip memory and never writes them to HBM (cuDNN, FlashAttention, TPU splash: what production runs use);
# "flash_triton" is the same algorithm as Tri Dao's 2022 Triton kernel (flash_attn_triton.py on triton-pre-mlir,
# llm-foundry's attn_impl "triton"), which keeps no scores either but runs at its own, lower rate on an H100
ATTENTION_KERNELS = ("xla", "flash", "flash_triton")
# whose autodiff decides what a layer keeps for its backward without remat: "jax" (every op's residuals, the
# workbench's program and MaxText's) or "pytorch" (PyTorch's autograd with fused norm and activation kernels, as
# torchtitan, Megatron-LM, NeMo and llm-foundry run: Korthikanti et al. 2022's count)
AUTOGRADS = ("jax", "pytorch")

__all__ = ["ATTENTION_KERNELS", "AUTOGRADS", "OPTIMIZERS", "REMATS", "TASKS"]
