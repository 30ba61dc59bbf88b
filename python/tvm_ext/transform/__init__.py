"""Target-neutral graph rewrites the pipeline runs before the strategy decides: the batch split
(:mod:`.split_batch`), batch-norm folding (:mod:`.fold_batch_norm`, for inference and for training), dense layers as 1x1
convolutions (:mod:`.matmul_as_conv2d`), channels-last blocks as NCHW (:mod:`.channels_last`) and
recognised activation decompositions (:mod:`.recognise_activations`), one constant per use
(:mod:`.unique_constants`); and the gradients tvm_ext registers (:mod:`.gradients`)."""

from .channels_last import channels_last_as_nchw
from .fold_batch_norm import fold_batch_norm, fold_trained_batch_norm
from .matmul_as_conv2d import matmul_as_conv2d
from .recognise_activations import recognise_silu
from .split_batch import runs_per_inference, split_batch
from .unique_constants import unique_constants

__all__ = ["channels_last_as_nchw", "fold_batch_norm", "fold_trained_batch_norm", "matmul_as_conv2d", "recognise_silu",
           "runs_per_inference", "split_batch", "unique_constants"]
