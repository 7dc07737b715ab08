"""Prints, as JSON, where the interpreter's packages keep what the build needs.

Run by the repository rule in tools/local_env.bzl with the project's interpreter. A missing
package is reported as null, so the build can say which one and how to install it.
"""

import importlib.util
import json
import os
import sys
import sysconfig


def package_dir(name):
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def version(dist):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def find_cuobjdump():
    # The CUDA toolkit here comes as pip wheels without cuobjdump; setup.sh pins the wheel.
    nvidia = package_dir("nvidia")
    for sub in ("cu13", "cuda_cuobjdump"):
        path = os.path.join(nvidia or "", sub, "bin", "cuobjdump")
        if nvidia and os.path.exists(path):
            return path
    return None


def main():
    torch_dir = package_dir("torch")
    torch_xla_dir = package_dir("torch_xla")
    jaxlib_dir = package_dir("jaxlib")
    pybind11_dir = package_dir("pybind11")
    xlac = None
    if torch_xla_dir:
        site = os.path.dirname(torch_xla_dir)
        names = [n for n in os.listdir(site) if n.startswith("_XLAC.") and n.endswith(".so")]
        xlac = os.path.join(site, names[0]) if names else None
    print(json.dumps({
        "python": sys.executable,
        "py_tag": "cp%d%d" % sys.version_info[:2],
        "python_include": sysconfig.get_paths()["include"],
        "pybind11_include": os.path.join(pybind11_dir, "include") if pybind11_dir else None,
        "torch_include": os.path.join(torch_dir, "include") if torch_dir else None,
        "torch_lib": os.path.join(torch_dir, "lib") if torch_dir else None,
        "xlac": xlac,
        "jaxlib_include": os.path.join(jaxlib_dir, "include") if jaxlib_dir else None,
        "cuobjdump": find_cuobjdump(),
        "versions": {d: version(d) for d in ("torch", "torch_xla", "jax", "jaxlib")},
    }))


if __name__ == "__main__":
    main()
