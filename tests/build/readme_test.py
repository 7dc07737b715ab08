"""The README against what it describes: its "GPU results" tables are rows of
bench/results/SUMMARY.md, quoted as they stand there, and its Layout names every module and
subpackage of torch_xla_ext. (Its commands and code blocks are run by
tests/serving/cli_generate_test.py and tests/vllm_platform/vllm_platform_test.py.)"""

import re
from pathlib import Path

README = Path("README.md").read_text()
SUMMARY = Path("bench", "results", "SUMMARY.md").read_text()
PACKAGE = Path("torch_xla_ext")


def _section(title):
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README.md has no section '## {title}' followed by another section"
    return match[1]


def test_the_gpu_results_tables_are_quoted_from_the_summary():
    rows = [line for line in _section("GPU results").splitlines() if line.startswith("|")]
    assert len(rows) >= 10, "the GPU results section quotes no table of SUMMARY.md"
    summary_lines = set(SUMMARY.splitlines())
    assert [row for row in rows if row not in summary_lines] == [], (
        "README.md's GPU results quote rows that bench/results/SUMMARY.md does not hold: copy "
        "them again from the regenerated summary")


def test_the_layout_names_every_module_of_the_package():
    layout = _section("Layout")
    modules = [p.name for p in sorted(PACKAGE.glob("*.py")) if p.name != "__init__.py"]
    packages = [p.name + "/" for p in sorted(PACKAGE.iterdir()) if (p / "__init__.py").is_file()]
    assert modules and packages
    missing = [name for name in modules + packages
               if not re.search(rf"(?<![\w/]){re.escape(name)}", layout)]
    assert missing == [], f"README.md's Layout leaves out torch_xla_ext's {missing}"
