"""The end every benchmark shares: its figures to --out (pretty JSON) and as stdout's last line
(after a table for people: training.metrics.print_table)."""

import json


def emit(figures: dict, out_path: str | None) -> None:
  if out_path:
    with open(out_path, 'w') as f:
      f.write(json.dumps(figures, indent=2) + '\n')
  print(json.dumps(figures))

