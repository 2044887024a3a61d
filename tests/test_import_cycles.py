"""The package's import graph has no cycles, imports inside functions included: a module that imports
one that imports it back (directly or round a longer circle) is one module split in two, and its lazy
import ("it builds on this module") hides the order the code is read in. tests/test_layers.py checks
the direction between layers; this checks it between any two modules."""

import grimp


def strongly_connected_components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` (each node's successors), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_strongly_connected_components():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert sorted(strongly_connected_components(graph)) == [["a", "b", "c"], ["d"]]


def test_no_module_imports_itself_back():
    imports = grimp.build_graph("research", cache_dir=None)
    graph = {module: imports.find_modules_directly_imported_by(module) for module in imports.modules}
    cycles = [component for component in strongly_connected_components(graph) if len(component) > 1]
    lines = []
    for component in cycles:
        # one circle through the component's first module, to name where to cut it
        chain = imports.find_shortest_chain(importer=component[1], imported=component[0])
        back = imports.find_shortest_chain(importer=component[0], imported=component[1])
        circle = " -> ".join([*(back or ()), *(chain or ())[1:]])
        lines.append(f"{', '.join(component)} import each other: {circle}")
    assert not lines, "import cycles:\n" + "\n".join(lines)
