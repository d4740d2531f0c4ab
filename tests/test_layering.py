"""One-way imports (design.md: "a stage never imports a stage above it"), read from the
source with ast, so imports inside functions count too (only `if TYPE_CHECKING:` blocks,
which never run, are left out).

ORDER is the stack, written once, lowest first: a module may import its own package and
any package below it, never one above. Module circles inside one package are allowed only
from ALLOWED_CIRCLES, each with its reason; a new circle, or one spanning packages, fails.
LAZY_CHECKED are the packages whose function-level imports must each delay a heavy library
(HEAVY, or a moetune module that imports one at its top) and say so in a comment. cli/ has
one allowance (CLI_LIGHT): there a command's import of its stage counts as delaying too.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

import moetune

PACKAGE = Path(moetune.__file__).parent

ORDER = (
    "errors", "units", "io", "registry", "ledger", "config",
    "model", "data", "engine", "recipe", "plan", "lint", "train",
    "evaluate", "export", "report", "demo", "bench", "lane", "api", "cli",
)  # fmt: skip
ENTRY_POINTS = {"__main__": "cli"}  # `python -m moetune` sits with the CLI

# frozenset of module names (without "moetune.") -> why the circle may stay
ALLOWED_CIRCLES: dict[frozenset[str], str] = {}  # none today; a new one names its reason

# Packages (or root modules) whose function-level imports are checked; extend as each is done.
LAZY_CHECKED = (
    "model", "data", "engine", "recipe", "lint", "evaluate", "export", "report", "ledger", "io",
    "config", "train", "plan", "lane", "demo", "bench", "cli", "units", "errors", "registry",
    "api",
)  # fmt: skip
# cli/'s allowance: each command imports its stage inside the function, so `moetune --help`
# and every command start without loading the other stages. There a function-level import
# of a moetune module outside these (and not already loaded by `import moetune.cli`) delays.
CLI_LIGHT = ("moetune.cli", "moetune.errors", "moetune.units", "moetune.registry")
# Libraries worth delaying: slow to import, or optional extras that may be missing.
HEAVY = frozenset(
    {
        "torch", "transformers", "peft", "trl", "accelerate", "datasets", "safetensors",
        "matplotlib", "jinja2", "mlx", "mlx_lm", "huggingface_hub", "httpx", "gguf",
        "lm_eval", "deepspeed", "psutil", "numpy", "vllm", "llama_cpp", "llama_cpp_py_sync",
        "sky", "runpod", "bitsandbytes", "torchao", "scipy", "tensorboard", "wandb", "mlflow",
        "trackio",
    }
)  # fmt: skip
PRAGMAS = ("noqa", "type:", "fmt:", "pragma")


@dataclass(frozen=True)
class Import:
    target: str  # absolute module name as written (moetune.x.y or a library)
    names: tuple[str, ...]  # the absolute dotted names it brings in (for `from` imports)
    line: int
    lazy: bool  # inside a function
    commented: bool  # a comment on it or on its block of imports (function-level only)


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _absolute(node: ast.ImportFrom, package: str) -> str:
    base = node.module or ""
    if not node.level:
        return base
    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{parent}.{base}" if base else parent


def _comment_lines(source: str) -> set[int]:
    """Lines holding a comment that says something (pragmas like noqa say nothing)."""
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        text = tok.string.lstrip("#").strip()
        if tok.type == tokenize.COMMENT and text and not text.startswith(PRAGMAS):
            lines.add(tok.start[0])
    return lines


def _block_commented(body: list[ast.stmt], i: int, comments: set[int], source: list[str]) -> bool:
    """Whether body[i] (an import) or the run of imports it belongs to carries a comment,
    on their lines or on comment lines just above the run."""
    start = i
    while start > 0 and isinstance(body[start - 1], ast.Import | ast.ImportFrom):
        start -= 1
    end = i
    while end + 1 < len(body) and isinstance(body[end + 1], ast.Import | ast.ImportFrom):
        end += 1
    first, last = body[start].lineno, body[end].end_lineno or body[end].lineno
    if any(first <= n <= last for n in comments):
        return True
    above = first - 1
    while above >= 1 and source[above - 1].strip().startswith("#"):
        if above in comments:
            return True
        above -= 1
    return False


def imports(source: str, package: str) -> list[Import]:
    """Every import statement of a module of `package`, TYPE_CHECKING blocks left out."""
    tree, comments, lines = ast.parse(source), _comment_lines(source), source.splitlines()
    found: list[Import] = []

    def visit(body: list[ast.stmt], lazy: bool) -> None:
        for i, node in enumerate(body):
            if _type_checking(node):
                visit(getattr(node, "orelse", []), lazy)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                said = lazy and _block_commented(body, i, comments, lines)
                for target, names in _targets(node, package):
                    found.append(Import(target, names, node.lineno, lazy, said))
            else:
                inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                for sub in _bodies(node):
                    visit(sub, inner)

    visit(tree.body, False)
    return found


def _bodies(node: ast.stmt) -> Iterator[list[ast.stmt]]:
    """The statement lists inside a compound statement (if/for/while/with/try/match/def/class)."""
    for field in ("body", "orelse", "finalbody"):
        sub = getattr(node, field, None)
        if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
            yield sub
    for holder in (*getattr(node, "handlers", ()), *getattr(node, "cases", ())):
        yield holder.body


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[tuple[str, tuple]]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name, ()
        return
    base = _absolute(node, package)
    yield base, tuple(f"{base}.{alias.name}" for alias in node.names)


# ---------------------------------------------------------------- the package's graph


def _name_of(path: Path) -> str:
    parts = ["moetune", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, list[Import]]:
    """Module name -> its imports, for every module of moetune."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _name_of(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out[name] = imports(path.read_text(encoding="utf-8"), package)
    return out


def _known(name: str) -> str | None:
    """The moetune module `name` resolves to (an attribute's module), or None."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


def edges(name: str, lazy: bool = True) -> set[str]:
    """The moetune modules `name` imports (`lazy=False`: at its top only)."""
    out = set()
    for imp in modules()[name]:
        if imp.lazy and not lazy:
            continue
        for target in (imp.target, *imp.names):
            found = _known(target) if target.startswith("moetune") else None
            if found and found != name:
                out.add(found)
    return out


def package_of(module: str) -> str | None:
    """The floor a module lives on (None for moetune/__init__ itself)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return ENTRY_POINTS.get(parts[1], parts[1])


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The circles of `graph` (components of more than one node), by Tarjan's walk."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while (w := stack.pop()) != v:
                comp.add(w)
            comp.add(v)
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# ---------------------------------------------------------------- the stack


def test_order_names_every_package_once() -> None:
    floors = {package_of(m) for m in modules()} - {None}
    assert len(set(ORDER)) == len(ORDER)
    assert floors == set(ORDER), f"add {floors - set(ORDER)} to ORDER / drop {set(ORDER) - floors}"


def test_no_import_runs_up_the_stack() -> None:
    """Lazy imports included: a function-level import up the stack is still a circle."""
    rank = {pkg: i for i, pkg in enumerate(ORDER)}
    up = []
    for name in modules():
        here = package_of(name)
        for target in edges(name):
            there = package_of(target)
            if here and there and rank[there] > rank[here]:
                up.append(f"{name} ({here}) imports {target} ({there})")
    assert up == []


def test_no_package_level_circle() -> None:
    graph: dict[str, set[str]] = {}
    for name in modules():
        here = package_of(name)
        if here:
            graph.setdefault(here, set()).update(
                p for t in edges(name) if (p := package_of(t)) and p != here
            )
    assert strongly_connected(graph) == []


def module_circles() -> list[frozenset[str]]:
    graph = {name: edges(name) for name in modules()}
    return [frozenset(m.removeprefix("moetune.") for m in c) for c in strongly_connected(graph)]


def test_module_circles_only_from_the_allow_list() -> None:
    circles = module_circles()
    spanning = [sorted(c) for c in circles if len({c_.split(".")[0] for c_ in c}) > 1]
    assert spanning == [], "a circle across packages is never allowed"
    new = [sorted(c) for c in circles if c not in ALLOWED_CIRCLES]
    assert new == [], "break the circle (or list it in ALLOWED_CIRCLES with its reason)"
    gone = [sorted(c) for c in ALLOWED_CIRCLES if c not in circles]
    assert gone == [], "these circles are gone: remove them from ALLOWED_CIRCLES"
    assert all(reason.strip() for reason in ALLOWED_CIRCLES.values())


def rooms_of(package: str) -> dict[str, set[str]]:
    """The rooms of one package (its direct modules and sub-folders, the face left out) and
    which rooms each imports: a sub-folder counts as one room, whatever module is used."""

    def room(name: str) -> str | None:
        parts = name.split(".")
        return ".".join(parts[:3]) if len(parts) > 2 and parts[1] == package else None

    graph: dict[str, set[str]] = {}
    for name in modules():
        if (here := room(name)) is not None:
            found = {there for t in edges(name) if (there := room(t)) not in (None, here)}
            graph.setdefault(here, set()).update(found)
    return graph


# package.room (a plug-in folder) -> why its folder may sit in a loop with its package
ALLOWED_ROOM_LOOPS: dict[str, str] = {
    "lane.providers": "a plug-in folder (peft's tuners/ shape): each provider uses the lane's "
    "own stages (transfer, launch, secrets) and the lane reaches the providers only through "
    "providers.base's registry",
}


def test_no_loop_between_the_rooms_of_a_package() -> None:
    """Folders by kind stay findable only if a folder never imports back into a room that
    imports it: plan/trace/ may use plan/step.py, but then step.py may not use trace/."""
    loops = []
    for package in ORDER:
        for circle in strongly_connected(rooms_of(package)):
            rooms = {r.removeprefix("moetune.") for r in circle}
            if not rooms & set(ALLOWED_ROOM_LOOPS):
                loops.append(sorted(rooms))
    assert loops == []
    assert {r.split(".")[0] for r in ALLOWED_ROOM_LOOPS} <= set(ORDER)


def test_the_new_rooms_are_folders_with_a_face() -> None:
    """The sub-folders the layout promises exist, each with an __init__ that says what it
    holds (a docstring) and, where it registers plug-ins, only those imports."""
    for room in FOLDERS:
        face = PACKAGE / room / "__init__.py"
        tree = ast.parse(face.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), f"{room}/__init__.py says nothing"
        body = tree.body[1:]
        assert all(isinstance(n, ast.ImportFrom) for n in body), f"{room}: only imports"


FOLDERS = (
    "model/fixes", "engine/quant", "engine/stored", "engine/offload", "plan/profiles",
    "plan/trace", "plan/devices", "plan/offload", "plan/serve", "plan/cost", "lint/rules",
    "lint/probes", "train/distributed", "train/rundir", "train/routing", "train/grpo",
    "train/mlx",
)  # fmt: skip


def test_no_folder_of_mixed_kinds_holds_more_than_twenty_files() -> None:
    """A folder of mixed kinds stays readable under ~20 files (peft, torchtune, litgpt);
    a folder of peers (one plug-in a file, like model/catalog or lane/providers) may grow."""
    peers = {"model/catalog"}
    crowded = {
        str(d.relative_to(PACKAGE)): n
        for d in PACKAGE.rglob("*")
        if d.is_dir() and (n := len([*d.glob("*.py")])) > 21
    }
    assert set(crowded) <= peers, crowded


# ---------------------------------------------------------------- function-level imports


def loaded_by(module: str) -> set[str]:
    """The moetune modules that importing `module` runs: its packages' `__init__`s and,
    transitively, what each imports at its top."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += edges(name, lazy=False)
    return seen


@cache
def heavy(module: str) -> bool:
    """Whether importing `module` (a moetune module or a library) loads a HEAVY library."""
    if not module.startswith("moetune"):
        return module.split(".")[0] in HEAVY
    found = _known(module)
    return found is not None and any(
        heavy(i.target)
        for name in loaded_by(found)
        for i in modules()[name]
        if not i.lazy and not i.target.startswith("moetune")
    )


def _checked(name: str) -> bool:
    return package_of(name) in LAZY_CHECKED


def _a_stage(target: str) -> bool:
    """Whether a cli/ import of `target` delays a stage (CLI_LIGHT)."""
    found = _known(target) if target.startswith("moetune.") else None
    light = found is None or found == "moetune" or found.startswith(CLI_LIGHT)
    return not light and found not in loaded_by("moetune.cli")


def delays(imp: Import, module: str) -> bool:
    """Whether a function-level import of `module` delays something worth delaying."""
    targets = (imp.target, *imp.names)
    if any(heavy(t) for t in targets):
        return True
    return package_of(module) == "cli" and any(_a_stage(t) for t in targets)


def lazy_problems() -> list[str]:
    problems = []
    for name, found in modules().items():
        if not _checked(name):
            continue
        for imp in (i for i in found if i.lazy):
            where = f"{name}:{imp.line} imports {imp.target}"
            if not delays(imp, name):
                problems.append(f"{where} inside a function: move it to the top")
            elif not imp.commented:
                problems.append(f"{where} inside a function without a comment saying why")
    return problems


def test_function_level_imports_only_delay_a_heavy_library() -> None:
    assert lazy_problems() == []


# ---------------------------------------------------------------- the walker itself


def test_the_walker_sees_lazy_relative_and_guarded_imports() -> None:
    """The checks above would pass vacuously if the walker missed imports."""
    lazy = "def f():\n    from moetune.lane import guard\n"
    (imp,) = imports(lazy, "moetune.recipe")
    assert imp.target == "moetune.lane" and imp.names == ("moetune.lane.guard",) and imp.lazy
    relative = "from ...lane.providers import base\nimport moetune.lane\n"
    assert [i.target for i in imports(relative, "moetune.recipe.sub")] == [
        "moetune.lane.providers",
        "moetune.lane",
    ]
    typing_only = "if TYPE_CHECKING:\n    import torch\nelse:\n    import json\n"
    assert [i.target for i in imports(typing_only, "moetune")] == ["json"]
    nested = "try:\n    import a\nexcept ImportError:\n    import b\nclass C:\n    def m(self):\n"
    nested += "        if x:\n            import c\n"
    assert [(i.target, i.lazy) for i in imports(nested, "moetune")] == [
        ("a", False),
        ("b", False),
        ("c", True),
    ]
    assert "moetune.plan.cost.walls" in edges("moetune.lane.launch")


@pytest.mark.parametrize(
    ("source", "commented"),
    [
        ("def f():\n    import torch\n", False),
        ("def f():\n    import torch  # heavy: loaded only here\n", True),
        ("def f():\n    # heavy: loaded only here\n    import json\n    import torch\n", True),
        ("def f():\n    import torch  # noqa: F401\n", False),
        ("def f():\n    # heavy\n    x = 1\n    import torch\n", False),
    ],
)
def test_the_walker_reads_a_comment_on_the_import_block(source: str, commented: bool) -> None:
    assert imports(source, "moetune")[-1].commented is commented


def test_heavy_follows_packages_and_top_level_imports() -> None:
    assert heavy("torch.nn") and not heavy("json") and not heavy("rich.table")
    assert heavy("moetune.engine.quant.stacks")  # engine/__init__ imports torch at its top
    assert not heavy("moetune.errors") and not heavy("moetune.registry")


def test_a_new_circle_or_lazy_import_would_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The allow-list and the lazy check bite: a circle and a needless lazy import planted
    into the parsed sources are reported."""
    planted = dict(modules())
    planted["moetune.model.planted_a"] = imports(
        "def f():\n    from moetune.errors import ConfigError\n", "moetune.model"
    )
    planted["moetune.model.planted_b"] = imports("import moetune.model.planted_a\n", "")
    planted["moetune.model.planted_a"] += imports("import moetune.model.planted_b\n", "")
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: planted)
    assert frozenset({"model.planted_a", "model.planted_b"}) in module_circles()
    assert any("moetune.errors inside a function: move it" in p for p in lazy_problems())


def test_cli_may_delay_a_stage_but_not_a_light_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """CLI_LIGHT's allowance: in cli/ a command's stage import counts as delaying (yet needs
    its comment); cli's own modules, errors/units, what `import moetune.cli` already loads,
    and anything outside cli/ still move to the top, comment or not."""
    cli = "\n".join([
        "def a():",
        "    from moetune.lane.providers import site_of",  # 2: a stage, said nothing
        "def b():",
        "    # lazy: the stage loads only when its command runs",
        "    from moetune.lane.providers import site_of",  # 5: a stage, said why
        "def c():",
        "    # lazy: the stage loads only when its command runs",
        "    from moetune.cli.render import spec_table",  # 8: cli's own
        "    from moetune.units import gib",  # 9
        "def d():",
        "    # lazy: the stage loads only when its command runs",
        "    from moetune.config import load_config",  # 12: loaded with moetune.cli anyway
    ])  # fmt: skip
    elsewhere = "def a():\n    # lazy: the stage loads\n    from moetune.lane.providers import x\n"
    planted = dict(modules())
    planted["moetune.cli.planted"] = imports(cli, "moetune.cli")
    planted["moetune.bench.planted"] = imports(elsewhere, "moetune.bench")
    monkeypatch.setattr(sys.modules[__name__], "modules", lambda: planted)
    assert "moetune.config" in loaded_by("moetune.cli")
    found = {p.split(" imports ")[0]: p for p in lazy_problems() if ".planted:" in p}
    assert found.keys() == {f"moetune.cli.planted:{n}" for n in (2, 8, 9, 12)} | {
        "moetune.bench.planted:3"
    }
    assert "without a comment" in found["moetune.cli.planted:2"]
    assert all("move it to the top" in p for k, p in found.items() if not k.endswith(":2"))
