"""Model room: the registry of named cost terms a model file may activate.

Adding a term: write a `Term` subclass (name, params with bounds, a docstring
with its physics, a pure `contribute`) in a module of this folder and list it
in `_ALL` below. It is inert until a model file or a candidate activates it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from hops_calib.model.terms.attention import AttentionScoreTraffic
from hops_calib.model.terms.base import Context, Contribution, Layout, Param, Term, layout_of
from hops_calib.model.terms.context_parallel import ContextParallelComm
from hops_calib.model.terms.decoder_kernels import DecoderKernels
from hops_calib.model.terms.dispatch import ChunkCallHost, LayerDispatchFloor, LayerLaunchFloor
from hops_calib.model.terms.elementwise import ElementwiseTraffic
from hops_calib.model.terms.embedding import EmbeddingGradAllReduce
from hops_calib.model.terms.host import IterationHostOverhead
from hops_calib.model.terms.input_embedding import InputEmbedding
from hops_calib.model.terms.link import LinkTransfer
from hops_calib.model.terms.optimizer import GradientSync, OptimizerStep
from hops_calib.model.terms.output_layer import OutputLayerLoss
from hops_calib.model.terms.parallel import DataParallelGradReduce, TensorParallelComm
from hops_calib.model.terms.roofline import DecoderRoofline

_ALL: tuple[Term, ...] = (
    DecoderRoofline(),
    LinkTransfer(),
    EmbeddingGradAllReduce(),
    OptimizerStep(),
    GradientSync(),
    IterationHostOverhead(),
    LayerDispatchFloor(),
    LayerLaunchFloor(),
    OutputLayerLoss(),
    InputEmbedding(),
    AttentionScoreTraffic(),
    ElementwiseTraffic(),
    TensorParallelComm(),
    DataParallelGradReduce(),
    ContextParallelComm(),
    DecoderKernels(),
    ChunkCallHost(),
)

TERMS: Mapping[str, Term] = MappingProxyType({term.name: term for term in _ALL})

__all__ = ["TERMS", "Context", "Contribution", "Layout", "Param", "Term", "layout_of"]
