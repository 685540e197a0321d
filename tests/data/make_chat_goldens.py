"""Makes tests/data/hf-chat: the tiny byte-level BPE of hf-llama-untied with chat special tokens
added (ids 300-306, inside the tiny models' 320), under four chat templates, and what
transformers' `apply_chat_template` makes of a few conversations with each.
tests/test_chat.py checks meshlm's rendering, ids and answer masks against these without
transformers.

  python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers tokenizers jinja2
  /tmp/hf/bin/python tests/data/make_chat_goldens.py

- llama3: Llama 3 Instruct's template (BOS, role headers, trimmed content, <|eot_id|>).
- chatml: Qwen2.5's layout, with a default system prompt where none is given.
- gemma: Gemma 3's template (BOS, a system prompt folded into the first user turn, the
  assistant named `model`, trimmed content, <end_of_turn>, alternation enforced).
- generation: ChatML with {% generation %} around the answers, which transformers turns into
  its own assistant mask (`return_assistant_tokens_mask`), and a raise_exception for roles
  that do not alternate; saved as chat_template.jinja, the file newer transformers writes.

goldens.json: per template, per conversation: `text` (rendered), `ids` (tokenized as
apply_chat_template does), `prompt` (all but the last answer, with the generation prompt), and for
`generation` transformers' `assistant_masks`.
"""

import json
import pathlib
import shutil

import tokenizers
import transformers

HERE = pathlib.Path(__file__).parent
OUT = HERE / 'hf-chat'
SPECIAL = ['<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>', '<|im_start|>', '<|im_end|>',
           '<start_of_turn>', '<end_of_turn>']

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}"
          "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
          "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
CHATML = ("{%- for message in messages %}\n"
          "    {%- if loop.first and messages[0]['role'] != 'system' %}\n"
          "        {{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}\n"
          "    {%- endif %}\n"
          "    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n' }}\n"
          "{%- endfor %}\n"
          "{%- if add_generation_prompt %}\n"
          "    {{- '<|im_start|>assistant\n' }}\n"
          "{%- endif %}\n")
GENERATION = ("{% for message in messages %}\n"
              "{% if message['role'] == 'assistant' %}\n"
              "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
              "{% endgeneration %}{{ '\n' }}\n"
              "{% elif message['role'] in ['system', 'user'] %}\n"
              "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}\n"
              "{% else %}\n"
              "{{ raise_exception('unknown role ' + message['role'] | tojson) }}\n"
              "{% endif %}\n"
              "{% endfor %}\n"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

GEMMA = ("{{ bos_token }}\n"
         "{%- if messages[0]['role'] == 'system' -%}\n"
         "    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
         "    {%- set loop_messages = messages[1:] -%}\n"
         "{%- else -%}\n"
         "    {%- set first_user_prefix = '' -%}\n"
         "    {%- set loop_messages = messages -%}\n"
         "{%- endif -%}\n"
         "{%- for message in loop_messages -%}\n"
         "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
         "        {{ raise_exception('Conversation roles must alternate user/assistant/user/"
         "assistant/...') }}\n"
         "    {%- endif -%}\n"
         "    {%- if message['role'] == 'assistant' -%}\n"
         "        {%- set role = 'model' -%}\n"
         "    {%- else -%}\n"
         "        {%- set role = message['role'] -%}\n"
         "    {%- endif -%}\n"
         "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}\n"
         "    {{- message['content'] | trim }}\n"
         "    {{- '<end_of_turn>\n' }}\n"
         "{%- endfor -%}\n"
         "{%- if add_generation_prompt -%}\n"
         "    {{ '<start_of_turn>model\n' }}\n"
         "{%- endif -%}\n")

CONVERSATIONS = [
    [{'role': 'user', 'content': 'What is 2 + 3?'},
     {'role': 'assistant', 'content': 'It is 5.'}],
    [{'role': 'system', 'content': 'Answer in one word.'},
     {'role': 'user', 'content': 'Capital of France?'},
     {'role': 'assistant', 'content': '  Paris \n'},
     {'role': 'user', 'content': 'And of Italy — in Italian?'},
     {'role': 'assistant', 'content': 'Roma'}],
    [{'role': 'user', 'content': 'def f(x):\n    return x'},
     {'role': 'assistant', 'content': 'This returns its argument: `f(3) == 3`.'},
     {'role': 'user', 'content': 'ünïcödé ✓'},
     {'role': 'assistant', 'content': '{"ok": true}'}],
]


def main():
  shutil.rmtree(OUT, ignore_errors=True)
  tok = tokenizers.Tokenizer.from_file(str(HERE / 'hf-llama-untied' / 'tokenizer.json'))
  tok.add_special_tokens(SPECIAL)
  goldens = {'conversations': CONVERSATIONS}
  for name, template in (('llama3', LLAMA3), ('chatml', CHATML), ('gemma', GEMMA),
                         ('generation', GENERATION)):
    directory = OUT / name
    directory.mkdir(parents=True)
    tok.save(str(directory / 'tokenizer.json'))
    config = {'bos_token': '<s>', 'eos_token': '</s>',
              'tokenizer_class': 'PreTrainedTokenizerFast'}
    if name == 'generation':
      (directory / 'chat_template.jinja').write_text(template)
    else:
      config['chat_template'] = template
    (directory / 'tokenizer_config.json').write_text(json.dumps(config, indent=2) + '\n')
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    cases = []
    for messages in CONVERSATIONS:
      case = {'text': hf.apply_chat_template(messages, tokenize=False),
              'ids': hf.apply_chat_template(messages, tokenize=True, return_dict=True)[
                  'input_ids'],
              'prompt': hf.apply_chat_template(messages[:-1], tokenize=False,
                                               add_generation_prompt=True)}
      if name == 'generation':
        case['assistant_masks'] = hf.apply_chat_template(
            messages, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True)['assistant_masks']
      cases.append(case)
    goldens[name] = cases
  goldens['transformers'] = transformers.__version__
  (OUT / 'goldens.json').write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + '\n')
  print(sorted(str(p.relative_to(OUT)) for p in OUT.rglob('*')))


if __name__ == '__main__':
  main()
