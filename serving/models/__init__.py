"""Model code for serving: DeepSeek-V3 (MLA + dense/MoE MLP) and its layers."""

from .deepseek_v3 import DeepseekV3ForCausalLM

__all__ = ["DeepseekV3ForCausalLM"]
