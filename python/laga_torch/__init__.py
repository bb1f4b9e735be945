"""laga's MLA forms for PyTorch trainers (docs/pytorch.md).

Pure Python over torch.distributed: the same code runs on CPU with gloo and
on GPUs with NCCL. The C++ tool (`laga`) is the reference, planner and
accountant; this package is how a trainer uses its forms.
"""

from .config import MLAConfig
from .layout import SpLayout, HeadContextGrid
from .comm import Ledger, redistribute
from .attention import attention
from .forms import FORMS, mla_attention
from .module import MLA, sync_gradients
from .trainer import sum_over_sequence_ranks

__all__ = ["MLAConfig", "SpLayout", "HeadContextGrid", "Ledger", "redistribute", "attention",
           "FORMS", "mla_attention", "MLA", "sync_gradients", "sum_over_sequence_ranks"]
