"""The shape of the code (docs/design.md; README "Where things live"): no import cycles, the training step imported
only by what trains, files of a readable size, every module listed for newcomers, nothing outside the repository cited.
Static checks of the source tree: nothing is imported or compiled."""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mtx"
# What may use the training step: the training loop, the audit of the training step's collectives (and the
# benchmarks and tests, which are outside the package).
STEP_USERS = {"mtx.run", "mtx.audit", "mtx.step"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every mtx module -> the mtx modules it imports anywhere in its body (function-level imports included)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycles():
    graph = _imports()
    graph.pop("mtx", None)  # the package's lazy name table points at everything and is imported by nothing inside
    for name in graph:
        graph[name].discard("mtx")
    seen, stack, on_stack = set(), [], set()

    def visit(node):  # depth-first search; a back edge is a cycle
        seen.add(node)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            assert nxt not in on_stack, "import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt])
            if nxt not in seen:
                visit(nxt)
        stack.pop()
        on_stack.discard(node)

    for node in sorted(graph):
        if node not in seen:
            visit(node)


def test_only_training_imports_the_training_step():
    """Generation, evaluation, conversion and loading take the ShardedModel; only the loop and the audit use the
    training step."""
    users = {name for name, deps in _imports().items() if "mtx.step" in deps} - {"mtx"}
    assert users <= STEP_USERS, users


def test_files_stay_readable():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    sizes = {f: len((ROOT / f).read_text().splitlines()) for f in tracked if (ROOT / f).is_file()}
    long = {f: n for f, n in sizes.items() if n > 400}
    assert not long, f"files over 400 lines: {long}"


def test_readme_lists_every_module():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Where things live"):]
    listed = set(re.findall(r"`(mtx/[\w/]+\.py)`", table))
    modules = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    assert modules - listed == set(), f"README's table misses {sorted(modules - listed)}"
    assert listed - modules == set(), f"README's table names missing files {sorted(listed - modules)}"


def test_the_repository_cites_nothing_outside_itself():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    pattern = re.compile(r"\.\./shared|\bDESIGN\.md|\bSTYLE\.md|\bGPU\.md")
    cited = [f for f in tracked if f != "tests/test_architecture.py" and (ROOT / f).is_file()
             and not f.endswith((".png", ".json")) and pattern.search((ROOT / f).read_text(errors="ignore"))]
    assert not cited, f"files citing something outside the repository: {cited}"


def test_every_command_line_tool_ends_through_exit_with():
    """A reader of a tool's output that goes away (`| head`) ends it in one line, not a traceback (mtx.errors)."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    tools = [f for f in tracked if 'if __name__ == "__main__":' in (ROOT / f).read_text()]
    bare = [f for f in tools if f != "mtx/convert_llama.py" and "exit_with(" not in (ROOT / f).read_text()]
    assert len(tools) > 15 and not bare, f"tools that end without mtx.errors.exit_with: {bare}"
