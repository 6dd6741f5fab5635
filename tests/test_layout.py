"""The maps stay true: docs/architecture.md's table is the one map of the package, and the README's file
map names only paths that exist."""

from __future__ import annotations

import re

from conftest import ROOT


def _package_entries() -> set[str]:
    package = ROOT / "fitrl"
    modules = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    folders = {f"{p.name}/" for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"}
    return modules | folders


def test_the_architecture_table_names_every_module_and_folder_of_the_package_and_nothing_else() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("## The package", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([a-z_0-9]+/?)` \|", table, flags=re.MULTILINE)
    assert len(listed) == len(set(listed)), "a module listed twice"
    assert set(listed) == _package_entries(), (
        f"missing from the map: {sorted(_package_entries() - set(listed))}; "
        f"in the map but not in fitrl/: {sorted(set(listed) - _package_entries())}"
    )


def test_the_readme_file_map_names_paths_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Where things are", 1)[1].split("```", 2)[1]
    paths = []
    for line in block.splitlines():
        if not line.strip() or line.startswith(" "):  # a continued description
            continue
        head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        paths += [p.strip() for p in head.split(",")]
    assert len(paths) > 10
    for path in paths:
        pattern = re.sub(r"<[a-z]+>", "*", path)
        assert list(ROOT.glob(pattern.rstrip("/"))), path
