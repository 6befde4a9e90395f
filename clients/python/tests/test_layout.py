"""The shape of the Python package (issue 29): the sync and asyncio
clients write no logic twice (every decision is in ``_engine`` and
``_common``; what stays in each client is how it waits), and no module
imports one that imports it back. Read from the source, nothing run."""

import ast
import os
import re

from conftest import PACKAGE_ROOT

KUNCI = os.path.join(PACKAGE_ROOT, "kunci")


def code_lines(path):
    """The lines that say something, as compared: stripped, white space
    folded, blank and comment-only lines left out, and ``await`` and
    ``async`` dropped (a blocking and an awaiting line of the same logic
    are the same line)."""
    lines = []
    with open(path, encoding="utf-8") as file:
        for number, text in enumerate(file, 1):
            text = text.strip()
            if not text or text.startswith("#"):
                continue
            text = re.sub(r"\b(await|async) ", "", re.sub(r"\s+", " ", text))
            lines.append((number, text))
    return lines


def shared_runs(first, second, least):
    """The longest runs of at least ``least`` equal lines of ``first`` and
    ``second`` (lists of ``(number, text)``), as line-number spans."""
    runs = []
    for shift in range(-(len(first) - 1), len(second)):
        i, length = max(0, -shift), 0
        while True:
            j = i + shift
            if i < len(first) and j < len(second) and first[i][1] == second[j][1]:
                length += 1
            else:
                if length >= least:
                    runs.append((first[i - length][0], first[i - 1][0],
                                 second[j - length][0], second[j - 1][0]))
                length = 0
                if i >= len(first) or j >= len(second):
                    break
            i += 1
    return sorted(runs)


def test_shared_runs_finds_a_repeated_run():
    one = [(n, t) for n, t in enumerate("a b c d e f g h".split(), 1)]
    two = [(n, t) for n, t in enumerate("x c d e f g h y a b".split(), 1)]
    assert shared_runs(one, two, 6) == [(3, 8, 2, 7)]
    assert shared_runs(one, two, 7) == []


def test_sync_and_asyncio_write_no_logic_twice():
    # Every decision is in _engine/_common; what stays in each client is how
    # it waits. No run of 6 lines or more is the same in both.
    runs = shared_runs(code_lines(os.path.join(KUNCI, "_sync.py")),
                       code_lines(os.path.join(KUNCI, "aio.py")), 6)
    assert runs == [], "\n".join("_sync.py:%d-%d ~ aio.py:%d-%d" % run for run in runs)


def imports_of(path):
    """The modules of the package that the module at ``path`` imports,
    anywhere in it (a function's imports too)."""
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                found.update(alias.name for alias in node.names)
            else:
                found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kunci."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names
                         if alias.name.startswith("kunci."))
    return found


def cycle_in(graph):
    """A cycle of ``graph`` (a dict of node to the nodes it points at) as
    a list of nodes, or ``None``."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_cycle_in_finds_a_cycle():
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_module_of_the_package_imports_one_that_imports_it_back():
    modules = [name[:-3] for name in os.listdir(KUNCI) if name.endswith(".py")]
    graph = {module: imports_of(os.path.join(KUNCI, module + ".py")) & set(modules)
             for module in modules}
    graph.pop("__init__")  # the package imports everything; nothing imports it
    for targets in graph.values():
        targets.discard("__init__")
    assert cycle_in(graph) is None, " -> ".join(cycle_in(graph))


def test_no_private_asyncio_internals():
    # A loop's or a transport's underscore attributes change between
    # CPython releases and differ in other loops (uvloop): the asyncio
    # client names none of them, not even through getattr.
    private = re.compile(r"\b(?:loop|transport)\._[a-z]|getattr\((?:loop|transport), \"_")
    with open(os.path.join(KUNCI, "aio.py"), encoding="utf-8") as file:
        found = [text.strip() for text in file if private.search(text)]
    assert found == []
