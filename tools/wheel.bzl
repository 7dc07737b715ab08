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

ENTRY_POINTS = {
    "console_scripts": ["torch-xla-ext = torch_xla_ext.cli:run"],
    # JAX calls initialize() of every jax_plugins module when its backends start.
    "jax_plugins": ["xla_ext = torch_xla_ext.jax_plugin"],
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
