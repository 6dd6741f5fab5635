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


def _imports_between_modules() -> dict[str, dict[str, int]]:
    """Every import of one fitrl module by another, those inside functions too: {importer: {imported: line}}."""
    import ast

    package = ROOT / "fitrl"
    modules = {}
    for path in package.rglob("*.py"):
        if "configs" in path.relative_to(package).parts:
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path

    def owner(dotted: str) -> str:  # `fitrl.stages.base.Stage` -> `fitrl.stages.base`
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted

    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = owner(target) if target.startswith("fitrl") else ""
                if found and found != name:
                    edges[name].setdefault(found, node.lineno)
    return edges


def test_no_import_cycle_in_the_package_not_even_inside_a_function() -> None:
    """A function-local import may defer a heavy library; one that hides a cycle between fitrl's own modules
    is a cycle all the same. A depth-first search finds any."""
    edges = _imports_between_modules()
    assert edges["fitrl.process"] and "fitrl.config" in edges["fitrl.process"]  # the walk sees imports
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = "open"
        path.append(module)
        for target in edges[module]:
            if state.get(target) == "open":
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_no_stage_name_literal_outside_the_stages_records_and_programs() -> None:
    """What a stage needs from the planner, the ending, the doctor or the report lives in its record
    (`fitrl/stages/<stage>.py`): nothing else branches on a stage's name. The programs
    (`fitrl/scripts/<stage>.py`) name their own stage."""
    import ast

    from fitrl.stages import NAMES

    found = set()
    package = ROOT / "fitrl"
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        if rel.parts[0] in ("stages", "configs") or (rel.parts[0] == "scripts" and path.stem in NAMES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in NAMES:
                found.add((rel.as_posix(), node.value))
    assert not found, f"stage names written outside their records: {sorted(found)}"
