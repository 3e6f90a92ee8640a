"""Build specdec and its compiled extension ``specdec._C``.

torch is not a declared dependency: bring your own and build against it with
``pip install --no-build-isolation -e .``. The extension is CPU-only (``CppExtension``) unless
torch was built with CUDA and a CUDA toolkit is found, in which case ``csrc/*.cu`` are compiled too.
"""
from glob import glob

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

CXX_FLAGS = ["-O3", "-std=c++20"]


def extension():
    sources = sorted(glob("csrc/*.cpp"))
    if torch.version.cuda and CUDA_HOME is not None:
        return CUDAExtension(
            "specdec._C",
            sources + sorted(glob("csrc/*.cu")),
            extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", "-std=c++20"]},
        )
    return CppExtension("specdec._C", sources, extra_compile_args={"cxx": CXX_FLAGS})


setup(
    name="specdec",
    version="0.1.0",
    python_requires=">=3.10",
    packages=find_packages(include=["specdec", "specdec.*"]) + ["specdec.triton_kernels"],
    package_dir={"specdec.triton_kernels": "kernels"},
    package_data={"specdec": ["data/*.jsonl"]},
    install_requires=["transformers>=5.0", "tqdm", "safetensors", "numpy"],
    entry_points={"console_scripts": ["specdec = specdec.cli:main"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
