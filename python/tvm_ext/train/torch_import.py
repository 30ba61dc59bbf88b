"""A PyTorch model as a `relax.training` backbone whose batch norms keep their running statistics.

TVM's importer (`from_exported_program`) binds a model's buffers as constants and drops their
updates, so a model trained through it never updates a batch norm's running mean and variance:
put back in eval mode, it normalizes with its initial statistics. Here the running statistics
(and `num_batches_tracked`) become the backbone's states, updated as PyTorch updates them: the
mean by momentum (or as a cumulative average, `momentum=None`), the variance from the batch's
*unbiased* variance (Relax's `batch_norm` uses the biased one, so its new running variance is
corrected here). After training,
:meth:`TorchBackbone.write_to` puts parameters and states back into the PyTorch model.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tvm
from tvm import relax

from ..errors import UnsupportedError
from ..relax_info import dtype, shape_text, static_shape

if TYPE_CHECKING:
    import torch

__all__ = ["TorchBackbone", "check_deterministic", "from_torch"]

_STATISTICS = ("running_mean", "running_var")


@dataclasses.dataclass(frozen=True)
class TorchBackbone:
    """A PyTorch model imported for `relax.training` (:func:`from_torch`).

    `mod`'s `backbone(inputs..., parameters..., states...)` returns (the model's output, the new
    states...), with the `param_num` and `state_num` attributes `SetupTrainer` reads.
    `params` and `states` are their values at import, in that order; `param_names` and
    `state_names` their PyTorch names (`model.state_dict()`'s keys)."""

    mod: tvm.IRModule
    params: list[np.ndarray]
    states: list[np.ndarray]
    param_names: list[str]
    state_names: list[str]

    @property
    def output_types(self) -> list[relax.TensorType]:
        """The types of the model's outputs (a tuple's flattened): the prediction arguments of a
        loss for `SetupTrainer`."""
        ret = self.mod["backbone"].ret_ty
        fields = list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]
        return fields[:len(fields) - len(self.states)]

    @property
    def output_type(self) -> relax.TensorType:
        """The type of the model's one output (:attr:`output_types` for several)."""
        types = self.output_types
        if len(types) != 1:
            raise ValueError(f"output_type: the model has {len(types)} outputs; see output_types")
        return types[0]

    def write_to(self, model: torch.nn.Module, params: Sequence[Any], states: Sequence[Any]) -> None:
        """Copy trained `params` and `states` (NumPy arrays or TVM tensors in the backbone's order,
        e.g. a Trainer's `export_params().values()` and `export_states().values()`) into `model`'s
        parameters and buffers, in place."""
        import torch

        for what, names, values in (("params", self.param_names, params), ("states", self.state_names, states)):
            if len(values) != len(names):
                raise ValueError(f"write_to: {what} has {len(values)} values, the backbone {len(names)}")
        tensors = dict(model.state_dict(keep_vars=True))
        for name, value in zip([*self.param_names, *self.state_names], [*params, *states], strict=True):
            if name not in tensors:
                raise ValueError(f"write_to: model has no parameter or buffer {name!r}")
            array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            target = tensors[name]
            if tuple(array.shape) != tuple(target.shape):
                raise ValueError(f"write_to: {name!r} is {tuple(target.shape)} in the model, {array.shape} here")
            with torch.no_grad():
                target.copy_(torch.from_numpy(np.array(array)))  # (ascontiguousarray makes 0-d 1-d)


def from_torch(model: torch.nn.Module, example_inputs: tuple) -> TorchBackbone:
    """Import `model` (as it is: a model in train mode normalizes with batch statistics, one in
    eval mode with its running statistics and has no states) for `tvm_ext.train.SetupTrainer`.

    Its trainable parameters (`requires_grad`) are the backbone's parameters; frozen ones are
    constants. Batch norms in train mode (whose running statistics are states, averaged by their
    momentum or, with `momentum=None`, cumulatively) must be called once per forward; dropout and
    stochastic depth must be in eval mode (no random numbers: the importer would drop them). The
    model itself is not changed."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"from_torch: model is {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(example_inputs, tuple) or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise TypeError("from_torch: example_inputs must be a tuple of torch tensors")
    norms = _training_norms(model)
    program = torch.export.export(_statistics_as_parameters(model, norms), example_inputs).run_decompositions()
    _check_mutations(program, norms)
    check_deterministic(program, "from_torch")

    from tvm.relax.frontend.torch import from_exported_program

    imported = from_exported_program(program, keep_params_as_input=True, unwrap_unit_return_tuple=True)
    # the importer's tuples around each batch norm, (y, mean, zeros, ...)[0], read back at once: left
    # in, Gradient would write zero adjoints for their fields (activation-sized zeros and adds)
    imported = relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(imported))
    main = imported["main"]
    by_target = {str(spec.target): spec.arg.name for spec in program.graph_signature.input_specs
                 if spec.kind == torch.export.graph_signature.InputKind.PARAMETER}
    values = dict(program.named_parameters())
    variables = {var.name: var for var in main.params}
    num_inputs = int(main.attrs["num_input"])
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    statistics = {_qualified(prefix, s): prefix for prefix in norms for s in _STATISTICS}
    param_names = [t for t in by_target if t in trainable]
    frozen = {by_target[t]: tvm.runtime.tensor(values[t].detach().numpy())
              for t in by_target if t not in trainable and t not in statistics}
    statistic_vars = {variables[by_target[t]]: prefix for t, prefix in statistics.items()}
    backbone, state_names = _backbone(main.bind_params(frozen) if frozen else main, num_inputs,
                                      [variables[by_target[t]] for t in param_names], statistic_vars, norms)
    states = [_state_value(model, name) for name in state_names]
    mod = tvm.IRModule({"backbone": backbone}).with_attr("param_num", len(param_names)) \
        .with_attr("state_num", len(state_names))
    return TorchBackbone(mod, [values[t].detach().numpy().copy() for t in param_names], states,
                         param_names, state_names)


def _qualified(prefix: str, name: str) -> str:
    """A module's tensor's name in the state dict ("" is the model itself: a bare BatchNorm2d)."""
    return f"{prefix}.{name}" if prefix else name


def _training_norms(model: torch.nn.Module) -> dict[str, Any]:
    """The batch norms whose running statistics a forward updates: name -> module."""
    import torch

    norms = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            continue
        if not (module.training and module.track_running_stats):
            continue
        norms[name] = module
    return norms


def _statistics_as_parameters(model: torch.nn.Module, norms: dict[str, Any]) -> torch.nn.Module:
    """A copy of `model` whose batch norms' running statistics are (frozen) parameters, so that
    the importer makes them function parameters instead of binding them as constants."""
    import torch

    if not norms:
        return model
    copied = copy.deepcopy(model)
    modules = dict(copied.named_modules())
    for name in norms:
        module = modules[name]
        for statistic in _STATISTICS:
            tensor = module._buffers.pop(statistic)
            assert tensor is not None  # (tracked statistics: _training_norms)
            setattr(module, statistic, torch.nn.Parameter(tensor, requires_grad=False))
        if module.momentum is None:
            # a cumulative average: its factor 1 / num_batches_tracked would be traced as this step's
            # number; with momentum 1 the import returns the batch's statistics, averaged in _backbone
            setattr(module, "momentum", 1.0)  # noqa: B010 (a Module attribute the type checker types as a Tensor)
    return copied


# ops that draw random numbers: TVM's importer makes dropout the identity and bernoulli its input
_RANDOM_OPS = ("dropout", "bernoulli", "rand", "normal", "uniform", "exponential", "multinomial", "poisson")


def check_deterministic(program: torch.export.ExportedProgram, caller: str) -> None:
    """Refuse (an UnsupportedError naming `caller`) an exported forward that draws random numbers
    (a Dropout or stochastic depth in train mode): TVM's importer would train without them,
    silently (EfficientNet's stochastic depth multiplies by an uninitialized tensor there)."""
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        if not any(part in name for part in _RANDOM_OPS):
            continue
        args = node.args
        if "dropout" in name and (len(args) > 1 and args[1] == 0 or len(args) > 2 and args[2] is False):
            continue  # (p = 0 or not training, as an undecomposed export writes eval mode: the identity)
        raise UnsupportedError(f"{caller}: the model draws random numbers in training mode ({name}: a Dropout, "
                               "or stochastic depth's bernoulli), which TVM's importer drops; put those modules "
                               "in eval mode to train without them")


def _check_mutations(program, norms: dict[str, Any]) -> None:
    """Refuse a model whose forward updates tensors other than its batch norms' statistics: the
    importer would drop those updates."""
    import torch

    kind = torch.export.graph_signature.OutputKind
    carried = {_qualified(prefix, s) for prefix in norms for s in (*_STATISTICS, "num_batches_tracked")}
    for spec in program.graph_signature.output_specs:
        if spec.kind in (kind.BUFFER_MUTATION, kind.PARAMETER_MUTATION) and spec.target not in carried:
            raise UnsupportedError(f"from_torch: the model's forward updates {spec.target!r}, which the import "
                                   "would drop (only batch norms' running statistics are carried)")
        if spec.kind == kind.USER_INPUT_MUTATION:
            raise UnsupportedError("from_torch: the model's forward updates one of its inputs in place")


def _backbone(main: relax.Function, num_inputs: int, params: list[relax.Var], statistic_vars: dict,
              norms: dict[str, Any]) -> tuple[relax.Function, list[str]]:
    """`main` as `backbone(inputs, params, states)` returning (output, new states), and the
    states' PyTorch names."""
    body = main.body
    if len(body.blocks) != 1 or not isinstance(body.blocks[0], relax.DataflowBlock):
        raise UnsupportedError("from_torch: the imported function is not one dataflow block")
    batch_norm = tvm.ir.Op.get("relax.nn.batch_norm")
    calls: dict[str, tuple[relax.Var, relax.Call]] = {}
    for binding in body.blocks[0].bindings:
        value = binding.value
        if not (isinstance(value, relax.Call) and value.op.same_as(batch_norm) and bool(value.attrs.training)):
            continue
        if value.args[3] in statistic_vars:
            calls[statistic_vars[value.args[3]]] = (binding.var, value)
        elif not isinstance(value.args[3], tvm.ir.expr.GenericConst):  # (a constant: no running statistics tracked)
            raise UnsupportedError("from_torch: a batch norm runs twice in one forward (its running statistics "
                                   "would be updated once)")
    missing = [prefix for prefix in norms if prefix not in calls]
    if missing:
        raise UnsupportedError(f"from_torch: batch norms {missing} did not import as training-mode batch_norm ops")
    states: list[relax.Var] = []
    state_names: list[str] = []
    counts: dict[str, relax.Var] = {}
    for prefix, (_, call) in calls.items():
        states += [call.args[3], call.args[4]]
        counts[prefix] = relax.Var(f"b_{prefix.replace('.', '_')}_num_batches_tracked", relax.TensorType((), "int64"))
        states.append(counts[prefix])
        state_names += [_qualified(prefix, s) for s in (*_STATISTICS, "num_batches_tracked")]
    bb = relax.BlockBuilder()
    with bb.function("backbone", [*main.params[:num_inputs], *params, *states]):
        with bb.dataflow():
            for binding in body.blocks[0].bindings:
                bb.emit_normalized(binding)
            result = body.body
            count = len(result.ty.fields) if isinstance(result.ty, relax.TupleType) else 0
            outputs = [bb.emit_output(relax.TupleGetItem(result, i)) for i in range(count)] if count else [result]
            updated: list[relax.Expr] = []
            for prefix, (norm, call) in calls.items():
                mean, var = relax.TupleGetItem(norm, 1), _unbiased_running_variance(norm, call)
                if norms[prefix].momentum is None:
                    mean, var = _cumulative_averages(call, counts[prefix], mean, var)
                updated += [bb.emit_output(mean), bb.emit_output(var),
                            bb.emit_output(relax.op.add(counts[prefix], relax.const(1, "int64")))]
        # SetupTrainer reads the states off the returned tuple itself (not a variable bound to it)
        # (a model's tuple of outputs flattened: SetupTrainer's loss takes them as its first arguments)
        bb.emit_func_output(relax.Tuple([*outputs, *updated]) if updated else body.body)
    return bb.get()["backbone"], state_names


def _unbiased_running_variance(norm: relax.Var, call: relax.Call) -> relax.Expr:
    """PyTorch's new running variance, (1 - m) * old + m * var * n / (n - 1), from Relax's
    batch_norm output (1 - m) * old + m * var (the batch's biased variance)."""
    shape = static_shape(call.args[0])
    if shape is None:
        raise UnsupportedError(f"from_torch: a batch norm's input is {shape_text(call.args[0])}: the running "
                               "variance's update needs its batch and image size known")
    count = int(np.prod(shape)) // shape[int(call.attrs.axis)]
    if count < 2:
        raise UnsupportedError("from_torch: a training-mode batch norm needs more than one value per channel")
    kind = dtype(call.args[4])  # (the running variance's: a float64 model's is float64)
    keep = relax.const(1 - float(call.attrs.momentum), kind)
    biased = relax.TupleGetItem(norm, 2)
    # (biased - keep * old) is m * var: the unbiased update adds m * var / (n - 1)
    return relax.op.add(biased, relax.op.multiply(relax.op.subtract(biased, relax.op.multiply(keep, call.args[4])),
                                                  relax.const(1 / (count - 1), kind)))


def _cumulative_averages(call: relax.Call, count: relax.Var, mean: relax.Expr,
                         var: relax.Expr) -> tuple[relax.Expr, relax.Expr]:
    """PyTorch's running statistics of a batch norm with momentum=None: old + (new - old) / n,
    n the batch count after this one, from the batch's mean and unbiased variance (`mean`,
    `var`: what the import at momentum 1 gives)."""
    op, kind = relax.op, dtype(call.args[3])
    factor = op.divide(relax.const(1, kind), op.astype(op.add(count, relax.const(1, "int64")), kind))
    return tuple(op.add(old, op.multiply(factor, op.subtract(new, old)))  # type: ignore[return-value]
                 for old, new in ((call.args[3], mean), (call.args[4], var)))


def _state_value(model: torch.nn.Module, name: str) -> np.ndarray:
    return model.state_dict()[name].detach().numpy().copy()
