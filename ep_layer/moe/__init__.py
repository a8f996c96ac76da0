"""DeepSeek-V3's fused MoE layer on ep_layer's dispatch and combine, low-latency or normal mode (docs/design.md
section 4)."""

from .experts import ExpertKernels, TorchExperts, make_expert_kernels
from .layer import DISPATCH_MODES, QUANT_MODES, FusedMoE, MoEStats, make_buffer
from .routing import RoutingConfig, noaux_tc_route, route
from .schedule import CommStreams, run_interleaved, run_to_end, run_two_microbatches
from .weights import ExpertWeights

__all__ = ["DISPATCH_MODES", "QUANT_MODES", "CommStreams", "ExpertKernels", "ExpertWeights", "FusedMoE", "MoEStats",
           "RoutingConfig", "TorchExperts", "make_buffer", "make_expert_kernels", "noaux_tc_route", "route",
           "run_interleaved", "run_to_end", "run_two_microbatches"]
