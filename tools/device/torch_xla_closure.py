"""torch 2.9 + torch_xla 2.9 + a CUDA PJRT plugin (and, with --vllm, vLLM 0.13) for a GPU
machine that has none of them and whose transfers carry at most 64 MiB per call
(tools/device/torch_xla_gpu.sh drives this).

  stage:  here, with PyPI: downloads the pinned wheels for the GPU machine's Python, builds the
          install tree, packs it as one .tar.xz cut into pieces of at most --piece-mib, one
          folder per piece (each carried by its own call), every piece's sha256 in each
          folder's MANIFEST.json.
  unpack: there: checks every piece against the manifest, extracts the tree, and links the
          plugin's CUDA 13 libraries to the machine's own.

With --vllm the tree also holds vLLM 0.13's Python package, without its CUDA extension
libraries (vllm/_C and the rest, 1.2 GB: its torch_xla path loads none of them), and those of
vLLM's dependencies the GPU machine lacks, or has at versions vLLM 0.13 does not take
(transformers 5, huggingface-hub 1), at requirements.txt's versions.

torch_xla needs only torch's CPU side, but torch 2.9's CPU libraries name CUDA 12 libraries as
NEEDED. The tree keeps libtorch_cpu, libtorch_python, libc10, libc10_cuda with the CUDA 12
runtime and CUPTI they load (small), and replaces libtorch_cuda.so (1 GB), cuSPARSELt and
cuFile by stubs that define exactly the symbols the kept libraries take from them; calling any
of those aborts with a message. cuDNN is the machine's (the plugin needs the real one). torch's own CUDA is never used in this tree: torch_xla
drives the GPU through the PJRT plugin, which loads its CUDA 13 libraries from the machine.
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

TORCH = "torch==2.9.0"
TORCH_XLA = "torch_xla==2.9.0"
CUDA_PLUGIN = "jax-cuda13-pjrt==0.7.2"  # PJRT C API 0.76, CUDA 13 (the shim adapts it)
# torch 2.9.0's own pins of the two CUDA 12 libraries its CPU side loads.
CUDA12_RUNTIME = ["nvidia-cuda-runtime-cu12==12.8.90", "nvidia-cuda-cupti-cu12==12.8.90"]
# What torch_xla and torch import that a Python with JAX and transformers may lack, at
# requirements.txt's versions.
PYTHON_DEPS = ["absl-py==2.5.1", "pyelftools==0.33", "PyYAML==6.0.3", "requests==2.34.2", "urllib3==2.8.0",
               "idna==3.20", "certifi==2026.10.18", "charset-normalizer==3.5.2"]
# vLLM's dependencies (their closure without extras, plus what `vllm serve` runs on) that the
# GPU machine's image lacks or has at versions vLLM 0.13 refuses; versions from requirements.txt.
VLLM_DEPS = [
    "annotated-types", "anthropic", "astor", "blake3", "cachetools", "cbor2", "cffi",
    "compressed-tensors", "depyf", "dill", "diskcache", "distro", "docstring-parser", "fastapi",
    "gguf", "hf-xet", "httptools", "httpx2", "huggingface-hub", "ijson", "interegular", "jiter",
    "jmespath", "jsonschema", "jsonschema-specifications", "lark", "llguidance",
    "lm-format-enforcer", "loguru", "mcp", "mcp-types", "mistral-common",
    "model-hosting-container-standards", "msgspec", "openai", "openai-harmony",
    "opentelemetry-api", "outlines-core", "partial-json-parser",
    "prometheus-fastapi-instrumentator", "pybase64", "pycountry", "pycparser", "pydantic", "pydantic-core",
    "pydantic-extra-types", "pyjwt", "python-dotenv", "python-json-logger", "python-multipart",
    "pyzmq", "referencing", "rpds-py", "setproctitle", "sniffio", "sse-starlette", "starlette",
    "supervisor", "tokenizers", "transformers", "typing-inspection", "uvicorn", "watchfiles",
    "websockets", "xgrammar",
]
REQUIREMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                            "requirements.txt")


def pinned(names):
    """`name==version` of each name, as requirements.txt pins it."""
    def norm(name):
        return name.replace("_", "-").replace(".", "-").lower()

    pins = {}
    with open(REQUIREMENTS) as f:
        for line in f:
            name, sep, version = line.strip().partition("==")
            if sep and not line.startswith("#"):
                pins[norm(name)] = version.split(";")[0].strip()
    missing = [n for n in names if norm(n) not in pins]
    if missing:
        raise SystemExit(f"requirements.txt pins none of {missing}")
    return [f"{n}=={pins[norm(n)]}" for n in names]


# Libraries dropped from torch/lib: the CUDA side, and what only it loads.
DROPPED = ["libtorch_cuda.so", "libtorch_cuda_linalg.so", "libtorch_nvshmem.so",
           "libcaffe2_nvrtc.so"]
# Stubbed NEEDED libraries of the kept ones, with how their symbols are recognised: those the
# dropped libraries define go to libtorch_cuda.so's stub (the kept libraries reach the others
# through it), the rest by C API prefix.
# cuDNN is not stubbed: the CUDA plugin loads the machine's libcudnn.so.9 by that name, and a
# stub loaded first would answer it (unpack links torch's nvidia/cudnn to the machine's).
STUBS = {
    "libtorch_cuda.so": None,
    "libcusparseLt.so.0": ("cusparseLt",),
    "libcufile.so.0": ("cuFile",),
}
# Functions of libtorch_cuda that libtorch_python calls while it loads, each answered by its
# stub as the real one would be at that point.
RETURNS_A_SLOT = {
    # c10d::get_gil_checker(): the GIL checker hook (a function pointer) NCCL's process group
    # reads; libtorch_python stores its checker into it.
    "_ZN4c10d15get_gil_checkerEv",
}
PLUGIN_DIR = "plugin"  # under the tree: jax_plugins/xla_cuda13/xla_cuda_plugin.so, nvidia/
SITE_DIR = "site"      # under the tree: put on PYTHONPATH
ARCHIVE = "torch_xla_gpu.tar.xz"


def run(*command, **kwargs):
    return subprocess.run(command, check=True, text=True, capture_output=True, **kwargs).stdout


def download(requirements, dest, python_version):
    run(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", python_version, "--platform", "manylinux_2_34_x86_64",
        "--platform", "manylinux_2_31_x86_64", "--platform", "manylinux_2_28_x86_64",
        "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux2014_x86_64",
        "--platform", "manylinux_2_17_x86_64", "-d", dest, *requirements)


def wheel_for(requirement, wheels):
    name = requirement.split("==")[0].replace("-", "_").lower()
    version = requirement.split("==")[1]
    for file in sorted(os.listdir(wheels)):
        if file.lower().startswith(f"{name}-{version}-") and file.endswith(".whl"):
            return os.path.join(wheels, file)
    raise SystemExit(f"no wheel for {requirement} in {wheels}")


def extract_wheel(path, dest, leave_out=()):
    """Extracts a wheel into `dest`, but the members whose names end with `leave_out`."""
    with zipfile.ZipFile(path) as wheel:
        for info in wheel.infolist():
            if info.filename.endswith(tuple(leave_out)):
                continue
            wheel.extract(info, dest)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(os.path.join(dest, info.filename), mode)


def dynamic_symbols(path, defined):
    """{name: (type, size)} of a library's defined dynamic symbols, or the set of its undefined
    non-weak ones."""
    lines = run("readelf", "-W", "--dyn-syms", path).splitlines()
    symbols = {} if defined else set()
    for line in lines:
        fields = line.split()
        if len(fields) < 8 or not fields[0].endswith(":"):
            continue
        _, _, size, kind, bind, _, index, name = fields[:8]
        name = name.split("@")[0]
        if defined and index != "UND" and kind in ("FUNC", "OBJECT", "IFUNC"):
            symbols[name] = (kind, int(size, 0))
        elif not defined and index == "UND" and bind != "WEAK" and name:
            symbols.add(name)
    return symbols


def elf_files(root):
    for folder, _, files in os.walk(root):
        for file in files:
            path = os.path.join(folder, file)
            if (".so" in file) and not os.path.islink(path):
                with open(path, "rb") as f:
                    if f.read(4) == b"\x7fELF":
                        yield path


def stub_source(soname, symbols):
    """Assembly for a stub library: every function traps, naming itself and the library;
    objects are zeroed, typeinfo objects made real (pybind11 reads their names when torch
    registers classes)."""
    functions = sorted(n for n, (kind, _) in symbols.items() if kind != "OBJECT")
    objects = sorted(n for n, (kind, _) in symbols.items() if kind == "OBJECT")
    lines = ["    .section .rodata", f'stub_library: .asciz "{soname}"', "    .text"]
    for i, name in enumerate(functions):
        lines += [f"    .globl {name}", f"    .type {name}, @function", f"{name}:"]
        if name in RETURNS_A_SLOT:  # a reference to a pointer-sized static, zero at first
            lines += [f"    leaq stub_slot_{i}(%rip), %rax", "    ret", "    .bss",
                      "    .balign 8", f"stub_slot_{i}: .zero 8", "    .text"]
            continue
        lines += ["    leaq stub_library(%rip), %rdi", f"    leaq stub_name_{i}(%rip), %rsi",
                  "    jmp torch_xla_gpu_stub_trap@PLT", "    .section .rodata",
                  f'stub_name_{i}: .asciz "{name}"', "    .text"]
    lines += ["    .data", "    .balign 16"]
    for name in objects:
        size = symbols[name][1]
        lines += [f"    .globl {name}", f"    .type {name}, @object", f"    .size {name}, {size}",
                  f"{name}:"]
        if name.startswith("_ZTI") and size >= 16:  # std::type_info: vtable, mangled name
            lines += ["    .quad _ZTVN10__cxxabiv117__class_type_infoE+16",
                      f"    .quad {name}_name", f"    .zero {size - 16}",
                      "    .section .rodata", f'{name}_name: .asciz "{name[4:]}"', "    .data",
                      "    .balign 16"]
        else:
            lines += [f"    .zero {max(size, 1)}", "    .balign 16"]
    return "\n".join(lines) + "\n"


TRAP_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((visibility("hidden"))) void torch_xla_gpu_stub_trap(const char* soname,
                                                                   const char* function) {
  fprintf(stderr, "torch_xla_gpu closure: %s is a stub (torch's CUDA side is not installed "
                  "here; torch_xla drives the GPU through its PJRT plugin), and its %s was "
                  "called\n", soname, function);
  abort();
}
"""


def symbol_table(paths):
    """(undefined, defined) dynamic symbol names of the libraries at `paths`, together."""
    undefined, defined = set(), set()
    for path in paths:
        undefined |= dynamic_symbols(path, defined=False)
        defined |= set(dynamic_symbols(path, defined=True))
    return undefined, defined


def missing_symbols(undefined, defined, dropped):
    """{stub soname: {name: (type, size)}}: the names undefined and not defined, attributed
    to the stubbed library that would have defined them."""
    wanted = {soname: {} for soname in STUBS}
    for name in sorted(undefined - defined):
        if name in dropped:
            wanted["libtorch_cuda.so"][name] = dropped[name]
            continue
        for soname, prefixes in STUBS.items():
            if prefixes and name.startswith(prefixes):
                wanted[soname][name] = ("FUNC", 0)
    return wanted


def build_stubs(lib_dir, wanted):
    """Writes the stub libraries into lib_dir."""
    with tempfile.TemporaryDirectory() as tmp:
        trap = os.path.join(tmp, "trap.c")
        with open(trap, "w") as f:
            f.write(TRAP_C)
        for soname, symbols in wanted.items():
            source = os.path.join(tmp, soname + ".s")
            with open(source, "w") as f:
                f.write(stub_source(soname, symbols))
            run("gcc", "-shared", "-fPIC", "-o", os.path.join(lib_dir, soname),
                f"-Wl,-soname,{soname}", source, trap, "-lstdc++")


def stage(args):
    python_version = args.python
    work = os.path.abspath(args.work)
    wheels = os.path.join(work, f"wheels-cp{python_version.replace('.', '')}")
    os.makedirs(wheels, exist_ok=True)
    vllm = pinned(["vllm", *VLLM_DEPS]) if args.vllm else []
    download([TORCH, TORCH_XLA, CUDA_PLUGIN, *CUDA12_RUNTIME, *PYTHON_DEPS, *vllm], wheels,
             python_version)
    tree = os.path.join(work, "tree")
    shutil.rmtree(tree, ignore_errors=True)
    site = os.path.join(tree, SITE_DIR)
    for requirement in (TORCH, TORCH_XLA, *CUDA12_RUNTIME, *PYTHON_DEPS, *vllm[1:]):
        extract_wheel(wheel_for(requirement, wheels), site)
    if vllm:  # its CUDA extensions (.so) left out
        extract_wheel(wheel_for(vllm[0], wheels), site, leave_out=(".so",))
    extract_wheel(wheel_for(CUDA_PLUGIN, wheels), os.path.join(tree, PLUGIN_DIR))
    # torch_xla_ext's entry points (PJRT_DEVICE=GPU is its `gpu` plugin) from the built wheel;
    # the package itself comes from the checkout on the GPU machine.
    with zipfile.ZipFile(args.wheel) as wheel:
        for name in wheel.namelist():
            if name.endswith((".dist-info/METADATA", ".dist-info/entry_points.txt")):
                wheel.extract(name, site)
    lib = os.path.join(site, "torch", "lib")
    dropped = {}
    for name in DROPPED:
        dropped.update(dynamic_symbols(os.path.join(lib, name), defined=True))
        os.remove(os.path.join(lib, name))
    # CUPTI's profiler-host libraries are loaded only by profiling tools.
    cupti = os.path.join(site, "nvidia", "cuda_cupti", "lib")
    for name in os.listdir(cupti):
        if name.startswith(("libnvperf", "libcheckpoint", "libpcsampling")):
            os.remove(os.path.join(cupti, name))
    undefined, defined = symbol_table(elf_files(site))
    wanted = missing_symbols(undefined, defined, dropped)
    build_stubs(lib, wanted)
    # _XLAC names libpythonX.Y.so.1.0 as NEEDED, which a Python linked statically (Ubuntu's)
    # does not ship; its symbols come from the interpreter. An empty library of that name on
    # _XLAC's RUNPATH satisfies the loader; where the real one is loaded, it is used instead.
    python_lib = f"libpython{python_version}.so.1.0"
    os.makedirs(os.path.join(site, "torch_xla", "lib"), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".c") as empty:
        run("gcc", "-shared", "-fPIC", "-o", os.path.join(site, "torch_xla", "lib", python_lib),
            f"-Wl,-soname,{python_lib}", empty.name)
    # The check: with the stubs in the tree, nothing a dropped library defined is missing.
    _, stubbed = symbol_table(os.path.join(lib, soname) for soname in STUBS)
    still = missing_symbols(undefined, defined | stubbed, dropped)
    if any(still.values()):
        raise SystemExit(f"symbols no stub defines: {still}")
    counts = {soname: len(symbols) for soname, symbols in wanted.items()}
    print("stubs:", ", ".join(f"{soname} ({n} symbols)" for soname, n in counts.items()))
    if args.tree_only:
        print(f"tree: {tree} (not packed)")
        return

    archive = os.path.join(work, ARCHIVE)
    print(f"packing {tree} (xz, a few minutes)")
    with open(archive, "wb") as out:
        tar = subprocess.Popen(["tar", "-C", tree, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", "-6", "-c"], stdin=tar.stdout, stdout=out, check=True)
        if tar.wait():
            raise SystemExit("tar failed")
    pieces_root = os.path.abspath(args.out)
    shutil.rmtree(pieces_root, ignore_errors=True)
    piece_bytes = args.piece_mib << 20
    pieces, whole = [], hashlib.sha256()
    with open(archive, "rb") as f:
        while chunk := f.read(piece_bytes):
            whole.update(chunk)
            name = f"{len(pieces) + 1}"
            os.makedirs(os.path.join(pieces_root, name))
            with open(os.path.join(pieces_root, name, "piece"), "wb") as out:
                out.write(chunk)
            pieces.append({"folder": name, "bytes": len(chunk),
                           "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"archive": ARCHIVE, "sha256": whole.hexdigest(), "pieces": pieces,
                "python": python_version,
                "contents": [TORCH, TORCH_XLA, CUDA_PLUGIN, *CUDA12_RUNTIME, *PYTHON_DEPS, *vllm],
                "stubs": counts}
    for piece in pieces:
        with open(os.path.join(pieces_root, piece["folder"], "MANIFEST.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    os.remove(archive)
    rel = os.path.relpath(pieces_root)
    print(f"{len(pieces)} pieces, {sum(p['bytes'] for p in pieces) >> 20} MiB; carry one per "
          "call: " + " ".join(f"{rel}/{p['folder']}" for p in pieces))


SITECUSTOMIZE = """\
# Written by tools/device/torch_xla_closure.py unpack, for the staged torch.
# - The machine's torchvision and torchaudio are built for its own torch, not this one:
#   importlib treats them as not installed.
# - This torch's CUDA library is a stub, but its CUDA runtime sees the GPU, so
#   torch.cuda.is_available() would say True and dynamo would then use torch's CUDA (its RNG
#   state) and fail: it says False, as for a CPU build of torch.
import importlib.abc
import importlib.machinery
import sys

for name in ("torchvision", "torchaudio"):
    sys.modules.setdefault(name, None)


class _CudaUnavailable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cuda":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.is_available = lambda: False

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _CudaUnavailable())
"""


def unpack(args):
    """Checks the pieces, extracts the tree into args.to (kept if already complete), links the
    plugin's nvidia/ to the machine's CUDA 13 libraries."""
    root = os.path.abspath(args.pieces)
    manifests = [os.path.join(root, d, "MANIFEST.json") for d in sorted(os.listdir(root))]
    manifests = [m for m in manifests if os.path.exists(m)]
    if not manifests:
        raise SystemExit(f"no pieces under {root}; carry them first (torch_xla_gpu.sh stage)")
    with open(manifests[0]) as f:
        manifest = json.load(f)
    done = os.path.join(args.to, "UNPACKED")
    if os.path.exists(done) and open(done).read() == manifest["sha256"]:
        print(f"{args.to}: already unpacked")
    else:
        missing = [p["folder"] for p in manifest["pieces"]
                   if not os.path.exists(os.path.join(root, p["folder"], "piece"))]
        if missing:
            raise SystemExit(f"pieces missing under {root}: {missing}; carry them first")
        whole = hashlib.sha256()
        for piece in manifest["pieces"]:
            with open(os.path.join(root, piece["folder"], "piece"), "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != piece["sha256"]:
                raise SystemExit(f"piece {piece['folder']}: sha256 differs from the manifest")
            whole.update(data)
        if whole.hexdigest() != manifest["sha256"]:
            raise SystemExit("the pieces put together differ from the staged archive")
        shutil.rmtree(args.to, ignore_errors=True)
        os.makedirs(args.to)
        cat = subprocess.Popen(["cat"] + [os.path.join(root, p["folder"], "piece")
                                          for p in manifest["pieces"]], stdout=subprocess.PIPE)
        with tarfile.open(fileobj=cat.stdout, mode="r|xz") as tar:
            tar.extractall(args.to, filter="tar")
        cat.wait()
        with open(done, "w") as f:
            f.write(manifest["sha256"])
    # The plugin finds its CUDA 13 libraries at $ORIGIN/../../nvidia/cu13/lib and the like;
    # torch's libraries find cuDNN at $ORIGIN/../../nvidia/cudnn/lib: both the machine's.
    nvidia = run(sys.executable, "-c", "import nvidia, os; print([p for p in nvidia.__path__ "
                 "if os.path.isdir(os.path.join(p, 'cu13'))][0])").strip()
    for link, target in ((os.path.join(args.to, PLUGIN_DIR, "nvidia"), nvidia),
                         (os.path.join(args.to, SITE_DIR, "nvidia", "cudnn"),
                          os.path.join(nvidia, "cudnn"))):
        if os.path.islink(link):
            os.remove(link)
        os.symlink(target, link)
    with open(os.path.join(args.to, SITE_DIR, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    print(json.dumps({"site": os.path.join(args.to, SITE_DIR),
                      "plugin": os.path.join(args.to, PLUGIN_DIR, "jax_plugins", "xla_cuda13",
                                             "xla_cuda_plugin.so"),
                      "nvidia": nvidia}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stage")
    s.add_argument("--python", default="3.12", help="the GPU machine's Python")
    s.add_argument("--work", default=".stage/work", help="downloads and the tree")
    s.add_argument("--out", default=".stage/torch_xla_gpu", help="the pieces, one per folder")
    s.add_argument("--piece-mib", type=int, default=58)
    s.add_argument("--wheel", default=next(iter(glob.glob("bazel-bin/torch_xla_ext-*.whl")), None),
                   help="torch_xla_ext's wheel, for its entry points (default: Bazel's)")
    s.add_argument("--vllm", action="store_true",
                   help="add vLLM 0.13 (without its CUDA extensions) and its missing dependencies")
    s.add_argument("--tree-only", action="store_true",
                   help="build the tree and stop (to try it on this machine)")
    u = sub.add_parser("unpack")
    u.add_argument("--pieces", default=".stage/torch_xla_gpu")
    u.add_argument("--to", default="/tmp/torch_xla_gpu")
    args = parser.parse_args()
    {"stage": stage, "unpack": unpack}[args.command](args)


if __name__ == "__main__":
    main()
