"""Triton kernels shared by the MoE layer (ep_layer.moe) and the serving model: the import guard and
the GPU's SM count (triton_support), the FP8 activation cast (fp8_cast), the grouped GEMM on dispatch's
masked layout (masked_gemm) and the dense block-FP8 linear (fp8_linear)."""
