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
# how a served model stores its weights ("int4": weight-only, AWQ / GPTQ with a 16-bit scale a group of 128;
# "fp4": NVFP4, 4-bit values with an fp8 scale a block of 16) and its KV cache: what a decode step reads from HBM
WEIGHT_DTYPES = ("bf16", "fp8", "int8", "int4", "fp4")
KV_DTYPES = ("bf16", "fp8", "int8")
# the serving engines whose measured steps price an engine's own cost a step (NVIDIA NIM runs TensorRT-LLM)
SERVING_ENGINES = ("TensorRT-LLM", "vLLM", "SGLang", "sglang-jax", "JetStream")

__all__ = ["ATTENTION_KERNELS", "AUTOGRADS", "KV_DTYPES", "OPTIMIZERS", "REMATS", "SERVING_ENGINES", "TASKS",
           "WEIGHT_DTYPES"]
