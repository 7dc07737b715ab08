"""xla_ext_kernel: the targets of one kernel folder (kernels/<op>/): the shared header with the
checks both platforms use, the Host handler and the CUDA handler."""

load("//tools:cuda.bzl", "cuda_library")

def xla_ext_kernel(op, cuda_deps = []):
    """Defines :<op>_h (<op>.h), :host (<op>_host.cc) and :cuda (<op>_cuda.cu).

    cuda_deps: the device code the CUDA handler launches beside its own (a kernel library
    such as //kernels/attention).
    """
    native.cc_library(
        name = op + "_h",
        hdrs = [op + ".h"],
        deps = [
            "//kernels/common:contract",
            "//kernels/common:data_checks",
            "//kernels/common:errors",
        ],
    )
    native.cc_library(
        name = "host",
        srcs = [op + "_host.cc"],
        # Holds only a static registration, which nothing references by name.
        alwayslink = True,
        deps = [
            ":" + op + "_h",
            "//kernels/common:host_float",
            "//kernels/registry",
        ],
    )
    cuda_library(
        name = "cuda",
        srcs = [op + "_cuda.cu"],
        deps = [
            ":" + op + "_h",
            "//kernels/common:cuda_utils",
            "//kernels/registry",
        ] + cuda_deps,
    )
