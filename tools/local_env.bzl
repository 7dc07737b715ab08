"""Repository rules that find the toolchain pieces already on this machine.

Nothing is downloaded: Python, torch, torch_xla and jaxlib come from the project's interpreter
($PYTHON_BIN, else ./.venv/bin/python3, else python3 on PATH), CUDA from $CUDA_HOME, else
/usr/local/cuda, else the nvcc on PATH. Both rules re-run when those variables change.
"""

def _workspace_root(ctx):
    return ctx.path(Label("//:WORKSPACE")).dirname

def _find_python(ctx):
    candidates = []
    if ctx.os.environ.get("PYTHON_BIN"):
        candidates.append(ctx.path(ctx.os.environ["PYTHON_BIN"]))
    candidates.append(_workspace_root(ctx).get_child(".venv").get_child("bin").get_child("python3"))
    for candidate in candidates:
        if candidate.exists:
            return candidate
    on_path = ctx.which("python3")
    if on_path:
        return on_path
    fail("No Python found: set PYTHON_BIN, or run ./setup.sh to create .venv.")

def _require(info, key, what):
    if not info.get(key):
        fail("%s was not found by %s; run ./setup.sh to install the pinned packages." %
             (what, info["python"]))
    return info[key]

def _python_env_impl(ctx):
    python = _find_python(ctx)
    result = ctx.execute([python, ctx.path(ctx.attr._locator)])
    if result.return_code != 0:
        fail("%s could not run tools/locate_python_env.py:\n%s" % (python, result.stderr))
    info = json.decode(result.stdout)

    ctx.symlink(_require(info, "python_include", "The Python headers"), "python_include")
    ctx.symlink(_require(info, "pybind11_include", "pybind11"), "pybind11_include")
    ctx.symlink(_require(info, "torch_include", "torch"), "torch_include")
    ctx.symlink(_require(info, "torch_lib", "torch"), "torch_lib")
    ctx.symlink(_require(info, "jaxlib_include", "jaxlib (for the XLA FFI headers)"), "jaxlib_include")
    ctx.symlink(_require(info, "xlac", "torch_xla's _XLAC extension"), "xlac/_XLAC.so")
    ctx.symlink(_require(info, "cuobjdump", "cuobjdump (nvidia-cuda-cuobjdump)"), "bin/cuobjdump")

    ctx.file("defs.bzl", """\"\"\"What @python_env found.\"\"\"

PYTHON_BIN = "{python}"
PY_TAG = "{py_tag}"
VERSIONS = {versions}
""".format(python = info["python"], py_tag = info["py_tag"], versions = info["versions"]))
    ctx.template("BUILD.bazel", ctx.attr._build_template, {})

python_env = repository_rule(
    implementation = _python_env_impl,
    attrs = {
        "_locator": attr.label(default = "//tools:locate_python_env.py"),
        "_build_template": attr.label(default = "//tools:python_env.BUILD"),
    },
    environ = ["PYTHON_BIN", "PATH"],
    local = True,
    configure = True,
)

def _local_cuda_impl(ctx):
    root = None
    if ctx.os.environ.get("CUDA_HOME"):
        root = ctx.path(ctx.os.environ["CUDA_HOME"])
    elif ctx.path("/usr/local/cuda/bin/nvcc").exists:
        root = ctx.path("/usr/local/cuda")
    elif ctx.which("nvcc"):
        root = ctx.which("nvcc").dirname.dirname
    if root == None or not root.get_child("bin").get_child("nvcc").exists:
        fail("No CUDA toolkit found: set CUDA_HOME to a directory holding bin/nvcc.")
    # nvcc finds cicc, ptxas and the headers relative to itself: mirror the whole layout.
    for child in root.readdir():
        ctx.symlink(child, child.basename)
    version = ctx.execute([root.get_child("bin").get_child("nvcc"), "--version"]).stdout
    ctx.file("defs.bzl", """\"\"\"What @local_cuda found.\"\"\"

CUDA_ROOT = "{root}"
NVCC_VERSION = {version}
""".format(root = root, version = repr(version.strip().split("\n")[-1])))
    ctx.template("BUILD.bazel", ctx.attr._build_template, {})

local_cuda = repository_rule(
    implementation = _local_cuda_impl,
    attrs = {"_build_template": attr.label(default = "//tools:local_cuda.BUILD")},
    environ = ["CUDA_HOME", "PATH"],
    local = True,
    configure = True,
)
