"""Chat formats built into the engine, for model files that carry no tokenizer.chat_template.

Kept apart from chat.py (which renders templates with jinja2) so that a load can look one up
without importing jinja2: the tokenizer asks for it on every load of such a file.
"""

# The chat format of a family whose files often carry no tokenizer.chat_template (as llama.cpp's
# built-in templates), by general.architecture. Gemma: a system message is folded into the first
# user turn; the assistant's role is 'model'.
BUILTIN_TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}"
        "{% if messages and messages[0]['role'] == 'system' %}"
        "{% set prefix = messages[0]['content'] | trim + '\n\n' %}{% set msgs = messages[1:] %}"
        "{% else %}{% set prefix = '' %}{% set msgs = messages %}{% endif %}"
        "{% for m in msgs %}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n'"
        " + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}
