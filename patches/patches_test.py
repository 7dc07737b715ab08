"""Checks the torch_xla patch series in patches/torch_xla/<tag>/.

Always: each series is numbered 0001.. without gaps, every patch is a `git format-patch`
mail with a subject and a commit message, and the custom-call hash header that 0002 adds
is patches/src/custom_call_hash.h verbatim (the file //patches:custom_call_hash_test
compiles).

Given a pristine torch_xla source tree of the tag (a checkout or a `git archive` export):

    TORCH_XLA_SRC_V2_8_1=/path/to/xla-2.8.1   # tag v2.8.1
    TORCH_XLA_SRC_V2_9_0=/path/to/xla-2.9.0   # tag v2.9.0
    TORCH_XLA_SRC=/path/to/xla                 # either; the tag is told by its XLA pin

it applies the series in order to a temporary copy of the tree (`git apply --check`, then
`git apply`; `patch -p1` where there is no git) and checks that the patched files hold the
intended changes. Without a tree those tests are skipped. Through Bazel:

    bazel test //patches:patches_test --test_env=TORCH_XLA_SRC_V2_9_0=/tmp/xla-2.9.0
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest


def _patches_dir() -> Path:
    # Under `bazel test` the working directory is the main repository's runfiles root.
    for candidate in (Path("patches"), Path(__file__).resolve().parent):
        if (candidate / "torch_xla").is_dir():
            return candidate
    raise RuntimeError("patches/torch_xla not found (cwd=%s)" % os.getcwd())


PATCHES = _patches_dir()
HASH_HEADER = PATCHES / "src" / "custom_call_hash.h"
HASH_HEADER_IN_TORCH_XLA = "torch_xla/csrc/ops/custom_call_hash.h"

# tag -> (environment variable, openxla/xla commit its WORKSPACE pins)
TAGS = {
    "v2.8.1": ("TORCH_XLA_SRC_V2_8_1", "9084478fa71d7661ad9b4c95f24107b53c8a4709"),
    "v2.9.0": ("TORCH_XLA_SRC_V2_9_0", "92f7b5952dd585c5be17c9a5caad27407005b513"),
}
EXPECTED_SUBJECTS = {
    "v2.8.1": [
        "Let _xla_gpu_custom_call take a target name and api_version",
        "Hash every attribute of a custom call; keep them all in Clone()",
        "Let custom calls alias outputs to operands",
        "Register typed XLA FFI handlers in PjRtComputationClient::RegisterCustomCall",
        "Link torch_xla_ext's kernels into _XLAC",
    ],
    "v2.9.0": [
        "Restore _xla_gpu_custom_call with a target name and api_version",
        "Hash every attribute of a custom call; keep them all in Clone()",
        "Let custom calls alias outputs to operands",
        "Register typed XLA FFI handlers in PjRtComputationClient::RegisterCustomCall",
        "Link torch_xla_ext's kernels into _XLAC",
    ],
}


def series(tag: str) -> list:
    return sorted((PATCHES / "torch_xla" / tag).glob("*.patch"))


def subject(patch: Path) -> str:
    text = patch.read_text()
    match = re.search(r"^Subject: \[PATCH \d+/\d+\] (.*(?:\n .*)*)", text, re.M)
    assert match, f"{patch.name}: no Subject header"
    return " ".join(line.strip() for line in match.group(1).splitlines())


def added_file(patch: Path, path: str) -> str:
    """The content of the file `path` that `patch` creates."""
    lines = patch.read_text().splitlines(keepends=True)
    start = lines.index(f"+++ b/{path}\n")
    assert lines[start - 1] == "--- /dev/null\n", f"{patch.name} does not create {path}"
    content = []
    for line in lines[start + 2:]:  # skip the @@ header
        if not line.startswith("+"):
            break
        content.append(line[1:])
    return "".join(content)


def source_tree(tag: str) -> Path:
    """The torch_xla tree given for `tag`, or skip."""
    variable, xla_pin = TAGS[tag]
    candidates = [os.environ.get(variable, "")]
    generic = os.environ.get("TORCH_XLA_SRC", "")
    if generic and xla_pin in Path(generic, "WORKSPACE").read_text(errors="replace"):
        candidates.append(generic)
    for candidate in candidates:
        if candidate:
            root = Path(candidate)
            assert (root / "torch_xla" / "csrc").is_dir(), f"{root} is no torch_xla tree"
            return root
    pytest.skip(
        f"no torch_xla {tag} source tree: set {variable} (or TORCH_XLA_SRC) to a pristine "
        f"checkout or `git archive {tag}` export of pytorch/xla, e.g. bazel test "
        f"//patches:patches_test --test_env={variable}=/tmp/xla-{tag[1:]}")


def apply(patch: Path, tree: Path, check: bool) -> subprocess.CompletedProcess:
    if shutil.which("git"):
        # Outside any git repository, `git apply` patches the working directory.
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
        command = ["git", "apply", "--whitespace=nowarn"] + (["--check"] if check else [])
        command.append(str(patch.resolve()))
    else:
        env = None
        command = ["patch", "-p1", "--forward", "--batch"] + (["--dry-run"] if check else [])
        command += ["-i", str(patch.resolve())]
    return subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module", params=sorted(TAGS))
def patched(request, tmp_path_factory):
    """(tag, the patched copy of the tag's tree)."""
    tag = request.param
    pristine = source_tree(tag)
    tree = tmp_path_factory.mktemp("src") / "xla"
    shutil.copytree(pristine, tree, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    assert not (tree / HASH_HEADER_IN_TORCH_XLA).exists(), (
        f"{pristine} is already patched")
    for patch in series(tag):
        checked = apply(patch, tree, check=True)
        assert checked.returncode == 0, (
            f"{patch.name} does not apply to {tag} after the ones before it:\n"
            f"{checked.stdout}{checked.stderr}")
        applied = apply(patch, tree, check=False)
        assert applied.returncode == 0, f"{patch.name}:\n{applied.stdout}{applied.stderr}"
    return tag, tree


# ---------------------------------------------------------------------------
# Without a source tree.


@pytest.mark.parametrize("tag", sorted(TAGS))
def test_series_is_numbered_and_described(tag):
    patches = series(tag)
    assert [p.name[:5] for p in patches] == [f"{i:04d}-" for i in range(1, len(patches) + 1)]
    assert [subject(p) for p in patches] == EXPECTED_SUBJECTS[tag]
    for patch in patches:
        text = patch.read_text()
        header, _, rest = text.partition("\n\n")
        message = rest.split("\n---\n", 1)[0]
        assert header.startswith("From "), patch.name
        assert len(message.split()) >= 20, f"{patch.name}: no commit message to speak of"
        assert "\ndiff --git a/" in text, patch.name


@pytest.mark.parametrize("tag", sorted(TAGS))
def test_hash_header_is_added_verbatim(tag):
    (hash_patch,) = [p for p in series(tag) if f"+++ b/{HASH_HEADER_IN_TORCH_XLA}\n" in
                     p.read_text()]
    assert added_file(hash_patch, HASH_HEADER_IN_TORCH_XLA) == HASH_HEADER.read_text()


@pytest.mark.parametrize("tag", sorted(TAGS))
def test_repository_rule_lists_the_series(tag):
    bzl = (PATCHES / "torch_xla.bzl").read_text()
    listed = bzl[bzl.index("TORCH_XLA_PATCHES = {"):]
    listed = listed[listed.index(f'"{tag}": ['):]
    listed = re.findall(r'"(\d{4}-[^"]+\.patch)"', listed[:listed.index("]")])
    assert listed == [p.name for p in series(tag)]
    assert f'"{tag}": "{TAGS[tag][1]}"' in bzl


def test_hash_header_is_standard_library_only():
    includes = re.findall(r"^#include\s+(\S+)", HASH_HEADER.read_text(), re.M)
    assert includes and all(i.startswith("<") for i in includes), includes


# ---------------------------------------------------------------------------
# With a source tree.


def read(tree: Path, path: str) -> str:
    return (tree / path).read_text()


def test_series_applies_in_order(patched):
    tag, tree = patched
    assert (tree / HASH_HEADER_IN_TORCH_XLA).read_text() == HASH_HEADER.read_text()


def test_gpu_custom_call_takes_target_and_api_version(patched):
    tag, tree = patched
    lower_h = read(tree, "torch_xla/csrc/xla_lower_util.h")
    assert re.search(
        r"BuildGpuCustomCall\(\s*const std::vector<xla::XlaOp>& inputs, "
        r"const xla::Shape& output_shape,\s*const std::string& payload, "
        r"const std::string& target, int api_version,", lower_h), lower_h
    lower = read(tree, "torch_xla/csrc/xla_lower_util.cpp")
    body = lower[lower.index("std::vector<xla::XlaOp> BuildGpuCustomCall("):]
    body = body[:body.index("\n}\n")]
    assert '"triton_kernel_call"' not in body
    assert "/*call_target_name=*/target" in body
    assert "static_cast<xla::CustomCallApiVersion>(api_version)" in body
    bindings = read(tree, "torch_xla/csrc/init_python_bindings.cpp")
    gpu = bindings[bindings.index('"_xla_gpu_custom_call"'):]
    gpu = gpu[:gpu.index(".def(")]
    for arg in ('py::arg("payload")', 'py::arg("target") = "triton_kernel_call"',
                'py::arg("api_version") = 2', 'py::arg("output_operand_aliases")'):
        assert arg in gpu, arg
    node = read(tree, "torch_xla/csrc/ops/gpu_custom_call.cpp")
    assert "target_, api_version_" in node
    assert (tree / "torch_xla/csrc/ops/gpu_custom_call.h").exists()
    assert "xla_gpu_custom_call" in read(tree, "torch_xla/csrc/ops/xla_ops.h")


def test_custom_call_hash_covers_every_attribute(patched):
    tag, tree = patched
    node = read(tree, "torch_xla/csrc/ops/custom_call.cpp")
    assert "torch::lazy::MHash(call_target)" not in node
    assert "torch::lazy::MHash(CustomCallHash(key))" in node
    for field in ("call_target", "backend_config", "api_version", "has_side_effect",
                  "outputs", "frontend_attributes", "output_operand_aliases"):
        assert f"key.{field} " in node or f"key.{field}." in node, field
    clone = node[node.index("CustomCall::Clone("):]
    clone = clone[:clone.index("\n}\n")]
    assert "frontend_attributes_" in clone and "output_operand_aliases_" in clone
    gpu = read(tree, "torch_xla/csrc/ops/gpu_custom_call.cpp")
    assert "torch::lazy::MHash(CustomCallHash(key))" in gpu
    assert "torch::lazy::MHash(payload)" not in gpu


def test_output_operand_aliases_reach_xla(patched):
    tag, tree = patched
    node = read(tree, "torch_xla/csrc/ops/custom_call.cpp")
    assert "/*output_operand_aliasing=*/{}" not in node
    assert "CustomCallOutputOperandAliasing(output_operand_aliases_," in node
    lower = read(tree, "torch_xla/csrc/xla_lower_util.cpp")
    assert "output_shape_index.push_back(output_index);" in lower
    bindings = read(tree, "torch_xla/csrc/init_python_bindings.cpp")
    custom = bindings[bindings.index('"_xla_custom_call"'):]
    custom = custom[:custom.index(".def(")]
    assert 'py::arg("output_operand_aliases") =' in custom
    assert "frontend_attributes, output_operand_aliases);" in custom
    methods = read(tree, "torch_xla/csrc/tensor_methods.cpp")
    assert methods.count("CheckOutputOperandAliases(inputs, output_xla_shapes,") == 2
    wrapper = read(tree, "torch_xla/experimental/stablehlo_custom_call.py")
    compile(wrapper, "stablehlo_custom_call.py", "exec")
    assert "output_operand_aliases=None" in wrapper


def test_register_custom_call_registers_typed_ffi_handlers(patched):
    tag, tree = patched
    header = read(tree, "torch_xla/csrc/runtime/pjrt_computation_client.h")
    decl = header[header.index("void RegisterCustomCall("):]
    decl = decl[:decl.index(";")]
    assert "int api_version" in decl and "not implemented" not in decl
    client = read(tree, "torch_xla/csrc/runtime/pjrt_computation_client.cpp")
    for needle in ("xla::ffi::GetXlaFfiApi()", "api->XLA_FFI_Handler_Register(&args)",
                   "constexpr int kApiVersionTypedFfi = 4;",
                   "dynamic_cast<xla::PjRtCApiClient*>(client_.get())",
                   '#include "xla/ffi/ffi_api.h"'):
        assert needle in client, needle
    if tag == "v2.9.0":
        # Plugins: the PJRT FFI extension's register_handler.
        assert "PJRT_Extension_Type::PJRT_Extension_Type_FFI" in client
        assert "->register_handler(&args)" in client
        assert '#include "xla/pjrt/c/pjrt_c_api_ffi_extension.h"' in client
    else:
        # The XLA pinned by 2.8 has no register_handler: the GPU extension, typed.
        assert "RegisterGpuCustomCallWithPlugin(c_api_client->pjrt_c_api()," in client
        assert "XLA_REGISTER_CUSTOM_CALL_TARGET_WITH_SYM" in client  # legacy kept
    build = read(tree, "torch_xla/csrc/runtime/BUILD")
    assert '"@xla//xla/ffi:ffi_api",' in build
    base = read(tree, "torch_xla/csrc/runtime/computation_client.h")
    assert re.search(r"RegisterCustomCall\([^)]*int api_version\) = 0;", base)
    bindings = read(tree, "torch_xla/csrc/init_python_bindings.cpp")
    reg = bindings[bindings.index('"_xla_register_custom_call_target"'):]
    reg = reg[:reg.index(".def(")]
    default = "4" if tag == "v2.9.0" else "0"
    assert f'py::arg("api_version") = {default}' in reg


def test_xlac_links_the_kernels(patched):
    tag, tree = patched
    build = read(tree, "BUILD")
    xlac = build[build.index('name = "_XLAC.so"'):]
    xlac = xlac[:xlac.index("\n)\n")]
    assert '"@torch_xla_ext//:kernels",' in xlac
    workspace = read(tree, "WORKSPACE")
    assert 'load("//bazel:torch_xla_ext.bzl", "torch_xla_ext_repository")' in workspace
    assert workspace.index('name = "torch_xla_ext"') < workspace.index('name = "xla"')
    kernels = read(tree, "bazel/torch_xla_ext.BUILD")
    assert 'copts = ["-DXLA_EXT_REGISTER_WITH_XLA_FFI_API"]' in kernels
    assert "alwayslink = True" in kernels
    rule = read(tree, "bazel/torch_xla_ext.bzl")
    assert 'environ = ["TORCH_XLA_EXT_SRC"]' in rule
