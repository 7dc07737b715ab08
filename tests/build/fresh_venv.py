"""A fresh virtual environment holding only the built wheel, as a user's `pip install` makes it;
its (large) dependencies come from the project's venv through a .pth file, and nothing is
downloaded."""

import os
import subprocess
import sys
import sysconfig


def install(wheel, directory):
    """Installs `wheel` into a new venv under `directory`; returns (python, site-packages)."""
    venv = os.path.join(directory, "venv")
    base_python = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base_python, "-m", "venv", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "project_deps.pth"), "w") as pth:
        pth.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    os.path.abspath(wheel)], check=True)
    return python, site
