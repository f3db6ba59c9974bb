"""Build of hetlb._C: host algorithms (pybind11) and tensor kernels (TORCH_LIBRARY).

Every csrc/**/*.cpp is compiled; the CUDA sources (csrc/**/*.cu: the kernels in csrc/ops/cuda) only
when a CUDA build of torch and the CUDA toolkit are both present (the torchao rule), unless
HETLB_NO_CUDA=1 or HETLB_FORCE_CUDA=1 says otherwise. The decision is printed. torch itself is never
downloaded here: install with `pip install --no-build-isolation -e .`.
"""
import glob
import os
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("hetlb builds against the installed torch: `pip install torch` first, then "
             "`pip install --no-build-isolation -e .`")

HERE = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def use_cuda() -> bool:
    """Decide whether to build the CUDA kernels, and say why."""
    if _flag("HETLB_NO_CUDA"):
        reason, ok = "HETLB_NO_CUDA=1", False
    elif _flag("HETLB_FORCE_CUDA"):
        reason, ok = "HETLB_FORCE_CUDA=1", True
    elif torch.version.cuda is None:
        reason, ok = f"torch {torch.__version__} is a CPU build", False
    elif CUDA_HOME is None:
        reason, ok = "no CUDA toolkit found (CUDA_HOME unset, no nvcc)", False
    else:
        reason, ok = f"torch CUDA {torch.version.cuda}, toolkit at {CUDA_HOME}", True
    print(f"hetlb: building {'CPU+CUDA' if ok else 'CPU-only'} extension ({reason})", flush=True)
    return ok


def extensions():
    cuda = use_cuda()
    rel = lambda pattern: sorted(os.path.relpath(p, HERE)
                                 for p in glob.glob(os.path.join(HERE, pattern), recursive=True))
    # csrc/module.cpp (the pybind11 module), csrc/ops (TORCH_LIBRARY schemas, cpu/ kernels),
    # csrc/solve (host algorithms), csrc/hook (the step core and the DDP hook).
    sources = rel("csrc/**/*.cpp")
    # -ffp-contract=off keeps float results bit-identical to hetlb.reference (no fused multiply-add).
    cxx = ["-O3", "-std=c++17", "-ffp-contract=off", "-fopenmp"]
    macros = []
    if cuda:
        sources += rel("csrc/**/*.cu")
        macros.append(("HETLB_WITH_CUDA", None))
        ext = CUDAExtension
        extra = {"cxx": cxx, "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]}
    else:
        ext = CppExtension
        extra = {"cxx": cxx}
    return [ext("hetlb._C", sources, include_dirs=[os.path.join(HERE, "csrc")],
                define_macros=macros, extra_compile_args=extra, extra_link_args=["-fopenmp"])]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
