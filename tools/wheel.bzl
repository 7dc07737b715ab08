"""py_wheel: packs a py_library, with the shared objects and headers in its runfiles, into a
wheel for this interpreter's tag (linux_x86_64), with METADATA, entry points and RECORD."""

load("@python_env//:defs.bzl", "PY_TAG")

# What the wheel asks pip for: exactly the versions it was built and tested against.
REQUIREMENTS = [
    "torch==2.9.0",
    "torch_xla==2.9.0",
    "jax==0.7.1",
    "jaxlib==0.7.1",
    "absl-py>=2.1",
    "numpy>=1.26",
    "pyelftools>=0.31",
]

# Optional dependencies for torch_xla on NVIDIA GPUs (PJRT_DEVICE=GPU), one CUDA PJRT plugin
# that torch_xla 2.9 can drive with the CUDA libraries it loads: `pip install
# 'torch_xla_ext[gpu]'`, CUDA 12 (PJRT C API 0.75, torch_xla 2.9's; the libraries of
# jax-cuda12-plugin[with-cuda]==0.7.1), or `'torch_xla_ext[gpu-cuda13]'`, CUDA 13 (0.76, adapted
# by the shim; the libraries of jax-cuda13-plugin[with-cuda]==0.7.2).
EXTRAS = {
    # vLLM on XLA through torch_xla_ext.vllm_platform (its torch pin is ours).
    "vllm": ["vllm==0.13.0"],
    "gpu": [
        "jax-cuda12-pjrt==0.7.1",
        "nvidia-cublas-cu12>=12.1.3.1",
        "nvidia-cuda-cupti-cu12>=12.1.105",
        "nvidia-cuda-nvcc-cu12>=12.6.85",
        "nvidia-cuda-nvrtc-cu12>=12.1.55",
        "nvidia-cuda-runtime-cu12>=12.1.105",
        "nvidia-cudnn-cu12>=9.8,<10.0",
        "nvidia-cufft-cu12>=11.0.2.54",
        "nvidia-cusolver-cu12>=11.4.5.107",
        "nvidia-cusparse-cu12>=12.1.0.106",
        "nvidia-nccl-cu12>=2.18.1",
        "nvidia-nvjitlink-cu12>=12.1.105",
        "nvidia-nvshmem-cu12>=3.2.5",
    ],
    "gpu-cuda13": [
        "jax-cuda13-pjrt==0.7.2",
        "nvidia-cublas>=13.0.0.19",
        "nvidia-cuda-cupti>=13.0.48",
        "nvidia-cuda-nvcc>=13.0.48",
        "nvidia-cuda-nvrtc>=13.0.48",
        "nvidia-cuda-runtime>=13.0.48",
        "nvidia-cudnn-cu13>=9.12.0.46,<10.0",
        "nvidia-cufft>=12.0.0.15",
        "nvidia-cusolver>=12.0.3.29",
        "nvidia-cusparse>=12.6.2.49",
        "nvidia-nccl-cu13>=2.27.7",
        "nvidia-nvjitlink>=13.0.39",
        "nvidia-nvshmem-cu13>=3.3.20",
        "nvidia-nvvm",
    ],
}

ENTRY_POINTS = {
    "console_scripts": ["torch-xla-ext = torch_xla_ext.cli:run"],
    # JAX calls initialize() of every jax_plugins module when its backends start.
    "jax_plugins": ["xla_ext = torch_xla_ext.jax_plugin"],
    # torch_xla registers each at import, under the upper-cased name: PJRT_DEVICE=GPU.
    "torch_xla.plugins": ["gpu = torch_xla_ext.plugin:CudaPlugin"],
    # vLLM asks each for its platform: ours where PJRT_DEVICE is CPU or GPU.
    "vllm.platform_plugins": ["xla = torch_xla_ext.vllm_platform:register"],
}

def _py_wheel_impl(ctx):
    package = ctx.attr.package
    files = depset(transitive = [
        package[PyInfo].transitive_sources,
        package[DefaultInfo].default_runfiles.files,
    ]).to_list()
    prefix = ctx.attr.package.label.package + "/"
    members = [f for f in files if f.short_path.startswith(prefix) and
               f.extension in ("py", "so", "h")]
    wheel = ctx.actions.declare_file("%s-%s-%s-%s-linux_x86_64.whl" % (
        ctx.attr.distribution,
        ctx.attr.version,
        PY_TAG,
        PY_TAG,
    ))
    args = ctx.actions.args()
    args.add("--out", wheel)
    args.add("--name", ctx.attr.distribution)
    args.add("--version", ctx.attr.version)
    args.add("--tag", "%s-%s-linux_x86_64" % (PY_TAG, PY_TAG))
    args.add("--summary", ctx.attr.summary)
    args.add_all(REQUIREMENTS, before_each = "--requires")
    for extra, requirements in EXTRAS.items():
        for requirement in requirements:
            args.add("--extra-requires", "%s:%s" % (extra, requirement))
    for group, entries in ENTRY_POINTS.items():
        for entry in entries:
            args.add("--entry-point", "%s:%s" % (group, entry))
    for f in members:
        args.add("--file", "%s=%s" % (f.short_path, f.path))
    ctx.actions.run(
        executable = ctx.executable._writer,
        arguments = [args],
        inputs = members,
        outputs = [wheel],
        mnemonic = "PyWheel",
    )
    return [DefaultInfo(files = depset([wheel]), runfiles = ctx.runfiles(files = [wheel]))]

py_wheel_rule = rule(
    implementation = _py_wheel_impl,
    attrs = {
        "package": attr.label(providers = [PyInfo]),
        "distribution": attr.string(),
        "version": attr.string(),
        "summary": attr.string(),
        "_writer": attr.label(default = "//tools:write_wheel", executable = True, cfg = "exec"),
    },
)

def py_wheel(name, package, version):
    py_wheel_rule(
        name = name,
        package = package,
        distribution = "torch_xla_ext",
        version = version,
        summary = "Custom GPU kernels as opaque XLA custom calls for PyTorch/XLA, JAX and torchax",
    )
