"""cuda_library: compiles .cu files with nvcc into a library that cc_library/cc_binary can use."""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")
load("//tools:cuda_flags.bzl", "CUDA_ARCH_FLAGS", "NVCC_FLAGS")


def _cuda_library_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    feature_configuration = cc_common.configure_features(
        ctx = ctx,
        cc_toolchain = cc_toolchain,
        requested_features = ctx.features,
        unsupported_features = ctx.disabled_features,
    )
    dep_cc_infos = [dep[CcInfo] for dep in ctx.attr.deps]
    compilation_context = cc_common.merge_cc_infos(cc_infos = dep_cc_infos).compilation_context

    include_flags = []
    for path in compilation_context.includes.to_list() + compilation_context.quote_includes.to_list():
        include_flags += ["-I", path]
    for path in compilation_context.system_includes.to_list():
        include_flags += ["-isystem", path]
    define_flags = ["-D" + d for d in compilation_context.defines.to_list()]
    header_inputs = compilation_context.headers.to_list() + ctx.files.hdrs

    objects = []
    for src in ctx.files.srcs:
        obj = ctx.actions.declare_file("_objs/%s/%s.o" % (ctx.label.name, src.basename))
        ctx.actions.run(
            executable = ctx.executable._nvcc,
            arguments = [
                "-ccbin",
                cc_toolchain.compiler_executable,
            ] + NVCC_FLAGS + [
                "-I",
                ".",
                "-I",
                ctx.bin_dir.path,
            ] + CUDA_ARCH_FLAGS + include_flags + define_flags + ctx.attr.copts + [
                "-c",
                src.path,
                "-o",
                obj.path,
            ],
            inputs = depset([src] + header_inputs, transitive = [ctx.attr._toolkit.files]),
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "nvcc %s" % src.short_path,
            use_default_shell_env = True,
        )
        objects.append(obj)

    archive = ctx.actions.declare_file("lib%s.a" % ctx.label.name)
    ctx.actions.run(
        executable = cc_toolchain.ar_executable,
        arguments = ["rcs", archive.path] + [o.path for o in objects],
        inputs = objects,
        outputs = [archive],
        mnemonic = "CudaArchive",
        use_default_shell_env = True,
    )
    library = cc_common.create_library_to_link(
        actions = ctx.actions,
        feature_configuration = feature_configuration,
        cc_toolchain = cc_toolchain,
        static_library = archive,
        pic_static_library = archive,
        # Kernel objects hold static handler registrations that nothing references by name.
        alwayslink = True,
    )
    linking_context = cc_common.create_linking_context(
        linker_inputs = depset([cc_common.create_linker_input(
            owner = ctx.label,
            libraries = depset([library]),
        )]),
    )
    own = CcInfo(
        compilation_context = cc_common.create_compilation_context(headers = depset(ctx.files.hdrs)),
        linking_context = linking_context,
    )
    return [
        DefaultInfo(files = depset([archive] + objects)),
        cc_common.merge_cc_infos(direct_cc_infos = [own], cc_infos = dep_cc_infos),
        OutputGroupInfo(objects = depset(objects)),
    ]

cuda_library = rule(
    implementation = _cuda_library_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = [".h", ".cuh"]),
        "deps": attr.label_list(providers = [CcInfo]),
        "copts": attr.string_list(),
        "_nvcc": attr.label(default = "@local_cuda//:nvcc", executable = True, cfg = "exec", allow_single_file = True),
        "_toolkit": attr.label(default = "@local_cuda//:toolkit_files"),
        "_cc_toolchain": attr.label(default = "@bazel_tools//tools/cpp:current_cc_toolchain"),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
    incompatible_use_toolchain_transition = True,
)
