"""torch_xla's source at a release tag with our patch series (patches/torch_xla/<tag>/) applied.

Nothing here is fetched by `bazel build //...` or `bazel test //...`: the only targets that
use these repositories (//patches:torch_xla_wheel_*) are tagged `manual`.

WORKSPACE:

    load("//patches:torch_xla.bzl", "torch_xla_source_repositories")

    torch_xla_source_repositories()

declares @torch_xla_v2_8_1 and @torch_xla_v2_9_0. Each takes its pristine tree from
$TORCH_XLA_SRC_V2_8_1 / $TORCH_XLA_SRC_V2_9_0 (or $TORCH_XLA_SRC: a checkout or `git archive`
export of the tag; its WORKSPACE must pin the tag's openxla/xla commit), else downloads the
tag's archive from GitHub, which needs --noexperimental_repository_disable_download (this
workspace's .bazelrc disables downloads). A failed download does not fail the fetch (so
`bazel sync` stays harmless offline): it is reported when the wheel target runs.

The repository holds the patched tree under src/ (torch_xla's own BUILD files are never loaded)
and one file, SOURCE_DIR: the absolute path of src/, or "ERROR: ..." when it could not be
prepared.
"""

# tag -> the openxla/xla commit its WORKSPACE pins (xla_hash).
TORCH_XLA_TAGS = {
    "v2.8.1": "9084478fa71d7661ad9b4c95f24107b53c8a4709",
    "v2.9.0": "92f7b5952dd585c5be17c9a5caad27407005b513",
}

_ARCHIVE_URL = "https://github.com/pytorch/xla/archive/refs/tags/%s.tar.gz"

def _env_name(tag):
    return "TORCH_XLA_SRC_" + tag.upper().replace(".", "_")

def _fail_later(ctx, message):
    ctx.file("SOURCE_DIR", "ERROR: " + message + "\n")
    ctx.file("BUILD.bazel", 'exports_files(["SOURCE_DIR"])\n')

def _run(ctx, command, environment = {}):
    result = ctx.execute(command, environment = environment, quiet = True)
    if result.return_code != 0:
        return "`%s` failed:\n%s%s" % (" ".join(command), result.stdout, result.stderr)
    return None

def _torch_xla_source_impl(ctx):
    tag = ctx.attr.tag
    src_dir = ctx.path("src")
    given = ctx.os.environ.get(_env_name(tag), "") or ctx.os.environ.get("TORCH_XLA_SRC", "")
    if given:
        if not ctx.path(given).get_child("torch_xla").exists:
            return _fail_later(ctx, "%s is no torch_xla source tree" % given)
        error = _run(ctx, ["mkdir", "-p", str(src_dir)]) or _run(ctx, [
            "bash",
            "-c",
            'tar -C "$1" --exclude=./.git -cf - . | tar -C "$2" -xf -',
            "copy",
            given,
            str(src_dir),
        ])
        if error:
            return _fail_later(ctx, error)
    else:
        downloaded = ctx.download_and_extract(
            url = _ARCHIVE_URL % tag,
            output = "src",
            stripPrefix = "xla-" + tag[1:],
            sha256 = ctx.attr.sha256,
            allow_fail = True,
        )
        if not downloaded.success:
            return _fail_later(ctx, (
                "could not download %s (set %s or TORCH_XLA_SRC to a pristine tree of the " +
                "tag, or build with --noexperimental_repository_disable_download)"
            ) % (_ARCHIVE_URL % tag, _env_name(tag)))
        if not ctx.attr.sha256:
            print("%s: downloaded %s, sha256 = \"%s\"" % (ctx.name, _ARCHIVE_URL % tag,
                                                         downloaded.sha256))

    workspace = src_dir.get_child("WORKSPACE")
    if not workspace.exists or TORCH_XLA_TAGS[tag] not in ctx.read(workspace):
        return _fail_later(ctx, "the torch_xla tree does not pin openxla/xla@%s: not %s" % (
            TORCH_XLA_TAGS[tag],
            tag,
        ))

    # Outside any git repository `git apply` patches the working directory; without git,
    # patch(1) does the same.
    git = ctx.which("git")
    for patch in ctx.attr.patches:
        path = str(ctx.path(patch))
        if git:
            error = _run(
                ctx,
                ["git", "-C", str(src_dir), "apply", "--whitespace=nowarn", path],
                environment = {"GIT_CEILING_DIRECTORIES": str(ctx.path("."))},
            )
        else:
            error = _run(ctx, ["patch", "-d", str(src_dir), "-p1", "--forward", "--batch",
                               "-i", path])
        if error:
            return _fail_later(ctx, "%s does not apply: %s" % (patch.name, error))

    ctx.file("SOURCE_DIR", str(src_dir) + "\n")
    ctx.file("PATCHES", "".join([p.name + "\n" for p in ctx.attr.patches]))
    ctx.file("BUILD.bazel", 'exports_files(["SOURCE_DIR", "PATCHES"])\n')

torch_xla_source = repository_rule(
    implementation = _torch_xla_source_impl,
    attrs = {
        "tag": attr.string(mandatory = True, values = TORCH_XLA_TAGS.keys()),
        "patches": attr.label_list(allow_files = [".patch"]),
        "sha256": attr.string(doc = "of the GitHub archive of the tag; empty: not checked"),
    },
    environ = ["TORCH_XLA_SRC", "TORCH_XLA_SRC_V2_8_1", "TORCH_XLA_SRC_V2_9_0"],
)

# The series, in order (kept in step with patches/torch_xla/<tag>/; patches_test checks the
# numbering).
TORCH_XLA_PATCHES = {
    "v2.8.1": [
        "0001-Let-_xla_gpu_custom_call-take-a-target-name-and-api_.patch",
        "0002-Hash-every-attribute-of-a-custom-call-keep-them-all-.patch",
        "0003-Let-custom-calls-alias-outputs-to-operands.patch",
        "0004-Register-typed-XLA-FFI-handlers-in-PjRtComputationCl.patch",
        "0005-Link-torch_xla_ext-s-kernels-into-_XLAC.patch",
    ],
    "v2.9.0": [
        "0001-Restore-_xla_gpu_custom_call-with-a-target-name-and-.patch",
        "0002-Hash-every-attribute-of-a-custom-call-keep-them-all-.patch",
        "0003-Let-custom-calls-alias-outputs-to-operands.patch",
        "0004-Register-typed-XLA-FFI-handlers-in-PjRtComputationCl.patch",
        "0005-Link-torch_xla_ext-s-kernels-into-_XLAC.patch",
    ],
}

def torch_xla_repository_name(tag):
    return "torch_xla_" + tag.replace(".", "_")

def torch_xla_source_repositories():
    for tag, patches in TORCH_XLA_PATCHES.items():
        torch_xla_source(
            name = torch_xla_repository_name(tag),
            tag = tag,
            patches = ["//patches:torch_xla/%s/%s" % (tag, p) for p in patches],
        )
