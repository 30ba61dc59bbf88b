"""timm's networks through tvm_ext.build: more networks nobody here wrote, checked against PyTorch.

Each model: random weights, batch-norm statistics from two batches of random images in training
mode, exported with torch.export and imported with Relax's frontend (tvm_ext.models.
torchvision_zoo.export), built with `tvm_ext.build`, its output compared with PyTorch eager's on
one random image. Prints per model the relative error (max |difference| over max |PyTorch|),
whether the top-5 agree, the convolutions on stock TVM (`fallback` in dispatch_report) and the
build time; a model that fails to import or build prints the error's first line. Correctness and
build time only: the latency benchmarks are bench/zoo.py and bench/e2e.py.

Needs timm (`pip install timm`; not a dependency of tvm_ext, so not in `make test`).

Usage: python bench/timm_zoo.py [--models gcresnet50t,...] [--size 96]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

# Convolutional families with ops the torchvision zoo lacks: global context, efficient channel
# attention, selective / split attention, normalization-free weight standardization, GRN, pooling
# mixers, re-parameterizable blocks, space-to-depth, anti-aliased downsampling, ghost modules,
# mixed depthwise kernels, "same" padding.
MODELS = (
    "resnet50d", "seresnext26d_32x4d", "ecaresnet26t", "skresnet18", "res2net50_26w_4s", "dla34", "dpn68",
    "cspresnet50", "cspdarknet53", "darknet53", "regnetz_b16", "mixnet_s", "ghostnet_100", "rexnet_100",
    "tf_efficientnet_b0", "dm_nfnet_f0", "nf_resnet26", "convnextv2_atto", "poolformer_s12", "repvgg_a0",
    "mobileone_s0", "fastvit_t8", "edgenext_xx_small", "tresnet_m", "inception_v4", "xception41", "selecsls42b",
    "ese_vovnet19b_dw", "hrnet_w18_small", "gernet_s", "lcnet_050", "tinynet_a", "resnest14d", "resnetaa50d",
    "gcresnet50t", "lambda_resnet26t", "hgnet_tiny", "ghostnetv2_100", "mobilenetv4_conv_small",
    "repghostnet_050", "cs3darknet_s", "resnetrs50",
)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated timm model names")
    ap.add_argument("--size", type=int, default=96, help="image size")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.size < 32:
        ap.error("--size must be >= 32 (the networks downsample by 32)")
    return args


def check(name: str, size: int, seed: int) -> str:
    """One table row: `name` built by tvm_ext against PyTorch eager."""
    import timm
    import torch
    import tvm
    from tvm import relax

    import tvm_ext
    from tvm_ext.models import torchvision_zoo

    torch.manual_seed(seed)
    model = torchvision_zoo.calibrate(timm.create_model(name, pretrained=False), size)
    mod, x = torchvision_zoo.export(model, size=size, seed=seed + 1)
    with torch.no_grad():
        want = model(torch.from_numpy(x)).numpy().astype(np.float64)
    fallbacks = sum(r.op == "nn.conv2d" and r.kernel == "fallback" for r in tvm_ext.dispatch_report(mod, "llvm"))
    start = time.perf_counter()
    ex = tvm_ext.build(mod, "llvm")
    seconds = time.perf_counter() - start
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    got = (got if isinstance(got, tvm.runtime.Tensor) else got[0]).numpy().astype(np.float64)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    top5 = set(np.argsort(got[0])[-5:]) == set(np.argsort(want[0])[-5:])
    return f"| {name} | {err:.1e} | {'yes' if top5 else 'NO'} | {fallbacks} | {seconds:.1f} |"


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    from tvm_ext.models import torchvision_zoo

    torchvision_zoo.import_torchvision()  # timm imports torchvision: without its compiled ops
    try:
        import timm  # noqa: F401
    except ImportError:
        print("bench/timm_zoo.py needs timm: pip install timm", file=sys.stderr)
        return 2
    print(f"# timm {timm.__version__}, {args.size}x{args.size}, batch 1, random weights (seed {args.seed})")
    print("| model | rel. error vs PyTorch | same top-5 | convs on stock TVM | build s |")
    print("|---|---|---|---|---|")
    failed = 0
    for name in args.models.split(","):
        try:
            print(check(name, args.size, args.seed), flush=True)
        except Exception as err:  # noqa: BLE001  (a table row per model, whatever fails)
            failed += 1
            first = (str(err).strip().splitlines() or [""])[0][:160]
            print(f"| {name} | {type(err).__name__}: {first} | | | |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
