"""py_pytest: a py_test that runs its sources with pytest."""

def py_pytest(name, srcs, deps = [], data = [], args = [], **kwargs):
    native.py_test(
        name = name,
        srcs = srcs + ["//tools:pytest_main.py"],
        main = "//tools:pytest_main.py",
        args = args + ["$(rootpath %s)" % src for src in srcs],
        deps = deps,
        data = data,
        python_version = "PY3",
        srcs_version = "PY3",
        **kwargs
    )
