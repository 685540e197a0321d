"""Every fault the probe knows (scripts/fault_probe.py: CASES, their one home), as a test: each
case runs as a user would (real files, processes and signals) and passes only when the probe
judges it GOOD. `python scripts/fault_probe.py` runs the same cases as a table."""

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location('fault_probe', REPO / 'scripts' / 'fault_probe.py')
fault_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fault_probe)

@pytest.fixture(scope='module')
def probe(tmp_path_factory):
  """One probe for the file: its trained run, TFDS data and compilation cache shared by the
  cases, as the script shares them."""
  return fault_probe.Probe(tmp_path_factory.mktemp('fault-probe'))


@pytest.mark.integration
@pytest.mark.parametrize('name', list(fault_probe.CASES))
def test_the_fault_ends_good(probe, name):
  verdict, seen = fault_probe.CASES[name](probe)
  assert verdict == 'GOOD', f'{name}: {verdict}: {seen}'
