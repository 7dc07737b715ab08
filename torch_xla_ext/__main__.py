"""`python -m torch_xla_ext {demo,doctor}`; also works as a file path, e.g.
`python site-packages/torch_xla_ext/__main__.py demo`."""

if not __package__:
    # Run as a file: Python put this folder first on sys.path. Import the package from its
    # parent folder instead, as `python -m` does.
    import os
    import sys

    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

from torch_xla_ext.cli import run  # noqa: E402

run()
