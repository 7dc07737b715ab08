"""Entry point of every py_pytest target: runs pytest on the files Bazel passes in, writing
JUnit XML where Bazel asks for it so skipped cases stay visible as skipped."""

import os
import sys

import pytest

if __name__ == "__main__":
    args = ["-v", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
    sys.exit(pytest.main(args + sys.argv[1:]))
