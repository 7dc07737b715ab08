"""The nvcc flags of every CUDA build: Bazel's cuda_library (tools/cuda.bzl) and, where there is
no Bazel, tools/device/build_kernels.sh (which reads this file as Python: keep it two plain
lists of strings)."""

# SASS for Ampere (sm_80) and Hopper with its wgmma/TMA instructions (sm_90a), and PTX
# for compute_90 so that newer GPUs can JIT-compile the kernels.
CUDA_ARCH_FLAGS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
]

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler=-fPIC,-fvisibility=hidden",
    "--expt-relaxed-constexpr",
    "--threads",  # the -gencode targets compile in parallel
    "0",
]
