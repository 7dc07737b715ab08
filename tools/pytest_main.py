"""Entry point of every py_pytest target: runs pytest on the files Bazel passes in."""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-v", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"] + sys.argv[1:]))
