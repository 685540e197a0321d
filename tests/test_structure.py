"""The tree as DEVELOPERS.md draws it: packages on floors, each importing only the floors below
it, no module importing itself back through others; and the docs naming only what exists."""

import ast
import importlib.util
import pathlib
import re

import pytest

import configs

REPO = pathlib.Path(__file__).resolve().parents[1]
# Lowest first (DEVELOPERS.md: Layout). Data flows config → mesh → abstract state → shardings →
# compiled step → loop: what a floor needs is below it, never above.
FLOORS = [('configs',), ('kernels', 'sharding', 'reporting'), ('model', 'runtime'),
          ('planning', 'data', 'interop'), ('training',), ('inference',), ('evaluation',)]
FLOOR = {package: i for i, packages in enumerate(FLOORS) for package in packages}


def modules() -> dict[str, pathlib.Path]:
  """{dotted name: file} of every module of the packages on FLOORS."""
  found = {}
  for package in FLOOR:
    for path in (REPO / package).rglob('*.py'):
      parts = path.relative_to(REPO).with_suffix('').parts
      found['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
  return found


def imports(path: pathlib.Path, known) -> set[str]:
  """The modules of `known` that `path` imports, at its top or inside a function."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [f'{node.module}.{alias.name}' for alias in node.names]
      found |= set(names) if all(name in known for name in names) else {node.module}
  return found & set(known)


def test_every_package_imports_only_the_floors_below_it():
  known = modules()
  assert set(FLOOR) == {p.name for p in REPO.iterdir() if (p / '__init__.py').exists()} - {
      'tests', 'benchmarks', 'scripts'}, 'a new package needs a floor here and in DEVELOPERS.md'
  upward = [f'{name} imports {target}' for name, path in known.items()
            for target in imports(path, known)
            if FLOOR[target.split('.')[0]] > FLOOR[name.split('.')[0]]
            or (FLOOR[target.split('.')[0]] == FLOOR[name.split('.')[0]]
                and target.split('.')[0] != name.split('.')[0])]
  assert not upward, upward


# Where a raw config (ml-collections, or its dict) is a parameter: the entry points, and
# settings.resolve, which makes it the Run (configs/base.py) that everything below takes.
TAKE_THE_CONFIG = {'training.loop.run', 'training.dry_run.plan', 'training.settings.resolve'}


def test_only_the_entry_points_take_the_config():
  """No function below the entry points has a `config` parameter: each takes the Run, or the
  typed section of it that it needs (DEVELOPERS.md: Layout)."""
  takers = {f'{name}.{node.name}' for name, path in modules().items()
            if not name.startswith('configs') for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef)
            and 'config' in [a.arg for a in node.args.args + node.args.kwonlyargs]}
  assert takers == TAKE_THE_CONFIG, takers


def test_below_training_functions_take_the_sections_they_read_not_a_run():
  """No function below `training/` takes a Run or training's Setup (a parameter so named or so
  annotated): each takes the sections of configs/base.py it reads (DEVELOPERS.md: Layout)."""
  below = {name: path for name, path in modules().items()
           if FLOOR[name.split('.')[0]] < FLOOR['training']}
  takers = set()
  for name, path in below.items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.FunctionDef):
        for arg in node.args.args + node.args.kwonlyargs:
          annotation = ast.unparse(arg.annotation) if arg.annotation else ''
          if arg.arg in ('run', 'setup') or annotation.split('.')[-1] in ('Run', 'Setup'):
            takers.add(f'{name}.{node.name}({arg.arg})')
  assert not takers, takers


@pytest.mark.integration
def test_the_gpu_target_is_resolved_in_one_place():
  """config.plan (`run.plan`, a PlanConfig) is read where the run's Target is resolved
  (planning/target.py, for training/settings.py); below the configs that set it, the rest reads
  the Target."""
  def reads_plan(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in configs.base.get_config().plan and (
        isinstance(node.value, ast.Attribute) and node.value.attr == 'plan'
        or isinstance(node.value, ast.Name) and node.value.id == 'plan_config')
  readers = {name for name, path in modules().items() if not name.startswith('configs')
             for node in ast.walk(ast.parse(path.read_text())) if reads_plan(node)}
  assert readers == {'planning.target'}, readers


def test_no_module_imports_itself_back_through_others():
  known = modules()
  graph = {name: imports(path, known) - {name} for name, path in known.items()}
  done, circles = set(), []

  def visit(name, path):
    for target in sorted(graph[name]):
      if target in path:
        circles.append(path[path.index(target):] + [target])
      elif target not in done:
        visit(target, path + [target])
    done.add(name)

  for name in sorted(graph):
    if name not in done:
      visit(name, [name])
  assert not circles, circles


DOCS = [REPO / 'README.md', REPO / 'DEVELOPERS.md', *sorted((REPO / 'docs').glob('*.md'))]
LINK = re.compile(r'\]\(([^)\s]+)\)')
CONFIG = re.compile(r'\bconfigs/[\w-]+\.py(?::[\w.-]*[\w-])?')  # a preset may hold a dot: qwen3.py:0.6b
MODULE = re.compile(r'\bpython3? -m ([\w.]+)')
SCRIPT = re.compile(r'\bpython3? ([\w/.-]+\.py)\b')


def anchors(path: pathlib.Path) -> set[str]:
  """The #fragments GitHub gives the headings of a markdown file."""
  text = re.sub(r'```.*?```', '', path.read_text(), flags=re.S)
  return {re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')
          for heading in re.findall(r'^#+ (.*)$', text, flags=re.M)}


def test_every_link_config_module_and_script_the_docs_name_exists():
  missing = []
  for doc in DOCS:
    text = doc.read_text()
    for target in LINK.findall(text):
      if re.match(r'[a-z]+:', target):
        continue  # a web address
      path, _, fragment = target.partition('#')
      file = (doc.parent / path).resolve() if path else doc
      if not file.exists() or (fragment and fragment not in anchors(file)):
        missing.append(f'{doc.name}: link {target}')
    for named in set(CONFIG.findall(text)) - {'configs/effects.py'}:  # a module, not a config
      try:
        configs.load(named.removeprefix('configs/'))
      except Exception as e:  # a file or preset that is not there
        missing.append(f'{doc.name}: {named} ({type(e).__name__}: {e})')
    for module in set(MODULE.findall(text)):
      if importlib.util.find_spec(module) is None:
        missing.append(f'{doc.name}: python -m {module}')
    for script in set(SCRIPT.findall(text)):
      if not (REPO / script).exists():
        missing.append(f'{doc.name}: python {script}')
  assert not missing, missing


def test_the_model_never_holds_a_mesh():
  """model/ names logical axes only: shard_map, PartitionSpec and the active mesh are sharding/'s
  (per_shard, per_stage, mesh_axis), so a mesh shape never changes model code."""
  held = [f'{name}: {node.attr if isinstance(node, ast.Attribute) else node.id}'
          for name, path in modules().items() if name.split('.')[0] == 'model'
          for node in ast.walk(ast.parse(path.read_text()))
          if (isinstance(node, ast.Attribute) and node.attr in MESH_HOLDERS)
          or (isinstance(node, ast.Name) and node.id in MESH_HOLDERS)
          or (isinstance(node, ast.alias) and node.name.split('.')[-1] in MESH_HOLDERS)]
  assert not held, held


MESH_HOLDERS = {'shard_map', 'PartitionSpec', 'get_abstract_mesh', 'NamedSharding', 'Mesh',
                'AbstractMesh', 'set_mesh', 'use_mesh'}


DATE = re.compile(r'\b20\d\d-\d\d(-\d\d)?\b')


def test_no_dated_line_outside_the_notes():
  """The docs say what is true now; what changed when is docs/notes/'s."""
  dated = [f'{doc.relative_to(REPO)}:{i}' for doc in DOCS
           for i, line in enumerate(doc.read_text().splitlines(), 1) if DATE.search(line)]
  assert not dated, dated


# A line carrying a measured or planned figure: a number with a unit of bytes, time or share.
FIGURE = re.compile(r'(?<![\w.])\d[\d.,]*\s?(GiB|MiB|KiB|GB|TB/s|GB/s|ms|µs|%|s\b|TFLOP)')


def test_the_docs_are_a_manual_not_a_lab_notebook():
  """At most 6% of README's and docs/' lines carry a figure: the docs say how to do things, each
  figure once, generated (scripts/doc_figures.py) or beside its command; sweeps and history are
  docs/notes/'s."""
  lines = [line for page in [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]
           for line in page.read_text().splitlines()]
  figures = [line for line in lines if FIGURE.search(line)]
  assert len(figures) <= 0.06 * len(lines), f'{len(figures)} of {len(lines)} lines carry a figure'


@pytest.mark.integration
def test_the_docs_figures_are_what_their_results_render():
  """Each `<!-- figures: NAME -->` block of the docs is what scripts/doc_figures.py renders from
  benchmarks/results/ (`python scripts/doc_figures.py` rewrites them)."""
  spec = importlib.util.spec_from_file_location('doc_figures', REPO / 'scripts' / 'doc_figures.py')
  figures = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(figures)
  assert 'figures: speed' in (REPO / 'README.md').read_text()
  assert not figures.stale(), 'run python scripts/doc_figures.py'
