"""config.data, typed: where the text comes from, what a record is, and how it becomes tokens
(configs/base.py says what each setting does). Its checks are data/tokens.py's `check_settings`;
the chat template is checked where it is read (data/chat.py: owned)."""

import dataclasses

from data import records


@dataclasses.dataclass(frozen=True)
class DataConfig:
  paths: str
  name: str
  text_key: str
  record: str
  prompt_field: str
  completion_field: str
  chosen_field: str
  rejected_field: str
  messages_field: str
  chat_template: str
  train_on: str
  train_split: str
  eval_split: str
  validation_fraction: float
  data_dir: str
  tokenizer: str
  tokenizer_model: str
  tokenize: str
  workers: int
  prefetch: int

  @property
  def preference(self) -> bool:
    """Whether records are preference pairs, trained on by DPO (config.dpo)."""
    return self.record in records.PREFERENCE_KINDS
