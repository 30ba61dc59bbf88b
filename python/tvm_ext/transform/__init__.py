"""Target-neutral graph rewrites the pipeline runs before the strategy decides: the batch split
(:mod:`.split_batch`), batch-norm folding (:mod:`.fold_batch_norm`, for inference and for training), dense
layers as 1x1 convolutions, float or quantized (:mod:`.matmul_as_conv2d`), quantized tensors moved in their
own dtype and moves that undo each other (:mod:`.quantized_movement`), channels-last blocks as NCHW
(:mod:`.channels_last`), 3-D convolutions over frames (:mod:`.conv3d_as_conv2d`), filter taps that read only
padding dropped (:mod:`.padding_taps`), recognised activation decompositions (:mod:`.recognise_activations`),
one constant per use (:mod:`.unique_constants`), arithmetic on constants in NumPy (:mod:`.numpy_folding`),
running statistics read apart from y (:mod:`.running_statistics`); and the gradients tvm_ext registers
(:mod:`.gradients`). Each returns a new module and leaves the one it was given as it was."""

from .channels_last import channels_last_as_nchw
from .conv3d_as_conv2d import conv3d_as_conv2d
from .fold_batch_norm import fold_batch_norm, fold_trained_batch_norm
from .matmul_as_conv2d import matmul_as_conv2d, quantized_matmul_as_conv2d
from .numpy_folding import fold_constants_in_numpy
from .padding_taps import drop_padding_taps, used_taps
from .quantized_movement import quantized_data_movement, replay_moves, undone_moves
from .recognise_activations import recognise_silu
from .running_statistics import split_running_statistics
from .split_batch import runs_per_inference, split_batch
from .unique_constants import unique_constants

__all__ = ["channels_last_as_nchw", "conv3d_as_conv2d", "drop_padding_taps", "fold_batch_norm",
           "fold_constants_in_numpy", "fold_trained_batch_norm", "matmul_as_conv2d",
           "quantized_data_movement", "quantized_matmul_as_conv2d", "recognise_silu", "replay_moves",
           "runs_per_inference", "split_batch", "split_running_statistics", "undone_moves",
           "unique_constants", "used_taps"]
