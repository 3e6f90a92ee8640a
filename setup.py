"""Build specdec and its compiled extension ``specdec._C``.

torch is not a declared dependency: bring your own and build against it with
``pip install --no-build-isolation -e .``. The extension is CPU-only (``CppExtension``) unless
torch was built with CUDA and a CUDA toolkit is found, in which case ``csrc/*.cu`` are compiled too.
"""
import sys
from glob import glob

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

# at::parallel_for is a header template: under torch's OpenMP backend it only runs in parallel when
# the extension itself is compiled with OpenMP (at run time it shares torch's own libgomp.so.1).
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []
# -ffp-contract=fast: a * b + c is one FMA wherever the ISA has it, in every template instantiation alike
# (the linear kernels' batch invariance rests on every row being summed with the same operations).
CXX_FLAGS = ["-O3", "-std=c++20", "-ffp-contract=fast", *OPENMP]


def extension():
    sources = sorted(glob("csrc/*.cpp"))
    if torch.version.cuda and CUDA_HOME is not None:
        return CUDAExtension(
            "specdec._C",
            sources + sorted(glob("csrc/*.cu")),
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", "-std=c++20"]},
            extra_link_args=OPENMP,
        )
    return CppExtension("specdec._C", sources, extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=OPENMP)


setup(
    name="specdec",
    version="0.1.0",
    python_requires=">=3.10",
    packages=find_packages(include=["specdec", "specdec.*"]) + ["specdec.triton_kernels"],
    package_dir={"specdec.triton_kernels": "kernels"},
    package_data={"specdec": ["data/*.jsonl", "data/drafts/*/*", "data/ngram_corpus/*.pt"]},
    install_requires=["transformers>=5.0", "tqdm", "safetensors", "numpy"],
    entry_points={"console_scripts": ["specdec = specdec.cli:main"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
