"""The end every benchmark shares: a two-column table for people, then its figures to --out
(pretty JSON) and as stdout's last line."""

import json


def emit(figures: dict, out_path: str | None) -> None:
  if out_path:
    with open(out_path, 'w') as f:
      f.write(json.dumps(figures, indent=2) + '\n')
  print(json.dumps(figures))


def table(rows: list[tuple[str, str]]) -> None:
  width = max(len(k) for k, _ in rows)
  for key, value in rows:
    print(f'{key:<{width}}  {value}')
