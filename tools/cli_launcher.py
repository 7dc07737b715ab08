"""Entry point of `bazel run //:demo`: starts the CLI as `python -m torch_xla_ext` does.

It lives outside the package folder on purpose: a file of the package run as a script would
put the package folder itself first on sys.path.
"""

from torch_xla_ext.cli import run

if __name__ == "__main__":
    run()
