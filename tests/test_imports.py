"""Module structure: the training and model packages import without cycles, function-local imports included (read,
not run)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imports(package: str) -> dict[str, set[str]]:
  """{module: the modules of `package` it imports anywhere in its body} (a package's own __init__ left out)."""
  folder = ROOT.joinpath(*package.split('.'))
  names = {f'{package}.{p.stem}' for p in folder.glob('*.py') if p.stem != '__init__'}
  graph = {}
  for name in names:
    deps = set()
    tree = ast.parse((folder / f'{name.rpartition(".")[2]}.py').read_text())
    typing_only = {  # `if TYPE_CHECKING:` imports name types for annotations; they never run
        id(n) for block in ast.walk(tree) if _type_checking(block) for s in block.body for n in ast.walk(s)
    }
    for node in ast.walk(tree):
      if id(node) in typing_only:
        continue
      if isinstance(node, ast.ImportFrom) and node.module:
        deps |= {m for m in (node.module, *(f'{node.module}.{a.name}' for a in node.names)) if m in names}
      elif isinstance(node, ast.Import):
        deps |= {a.name for a in node.names if a.name in names}
    graph[name] = deps - {name}
  return graph


def _type_checking(node) -> bool:
  return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == 'TYPE_CHECKING'


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of `graph` as a path that ends where it starts, or None."""
  state = {}

  def visit(node, path):
    state[node] = 'open'
    for dep in sorted(graph[node]):
      if state.get(dep) == 'open':
        return path[path.index(dep) :] + [dep]
      if dep not in state and (found := visit(dep, path + [dep])):
        return found
    state[node] = 'done'
    return None

  for node in sorted(graph):
    if node not in state and (found := visit(node, [node])):
      return found
  return None


def test_cycle_finder_finds_one():
  assert cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert cycle({'a': {'b'}, 'b': set()}) is None


def test_train_has_no_import_cycle():
  graph = imports('specjax.train')
  assert {'specjax.train.trainers', 'specjax.train.base', 'specjax.train.eagle3'} <= set(graph)
  assert 'specjax.train.eagle3' in graph['specjax.train.trainers']  # the graph sees imports
  assert cycle(graph) is None, ' -> '.join(cycle(graph))


def test_models_have_no_import_cycle():
  graph = imports('specjax.models')
  assert 'specjax.models.mtp' in graph['specjax.models.qwen3_5']  # the hybrids build the MTP head
  assert cycle(graph) is None, ' -> '.join(cycle(graph))
