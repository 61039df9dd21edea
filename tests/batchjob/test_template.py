"""The chat template's compilation (pipeline/batchjob/template.py): rendered as transformers
renders chat templates, and nothing of it evaluated at load, whatever construct holds the
expression (an output, a test, a filter, an autoescape block): a template that would
allocate at load allocates nothing until it renders."""

from __future__ import annotations

import tracemalloc

import jinja2
import pytest

from pipeline.batchjob.template import MAX_TEMPLATE_BYTES, compile_chat_template, read_chat_template
from pipeline.wire.errors import ModelDirError

# Characters each construct below would allocate if it were evaluated at load.
FOLDED_CHARS = 20_000_000


@pytest.mark.parametrize("source", [
    "{{ 'A' * N }}", "{{ 'A' | center(N) }}", "{% if 'A' * N %}{% endif %}", "{{ ['A'] * N }}",
    "{% autoescape 'A' | center(N) %}x{% endautoescape %}", "{{ ('A' * N) | length }}", "{% set x = 'A' * N %}",
    "{{ 'x' ~ ('A' | center(N)) }}", "{% for c in 'A' | center(N) %}{% endfor %}",
])
def test_nothing_is_evaluated_at_load(source):
    tracemalloc.start()
    template = compile_chat_template(source.replace("N", str(FOLDED_CHARS)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < FOLDED_CHARS // 10, peak
    assert template is not None


def test_it_renders_as_transformers_renders_chat_templates():
    template = compile_chat_template(
        "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{{ m | tojson }}{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}\n"
        "  {% if add_generation_prompt %}<go>{% endif %}{{ none_given }}{{ 7 // 2 }}{{ 'a' * 2 }}")
    messages = [{"role": "user", "content": "<a> & 'é'"}, {"role": "user", "content": "x"}]
    # tojson keeps <, &, ' and non-ASCII as they are; break works; trim/lstrip blocks eat the
    # newline after a block and the spaces before one; undefined is empty; operators work.
    assert template.render(messages=messages, add_generation_prompt=True) == \
        '{"role": "user", "content": "<a> & \'é\'"}<go>3aa'
    with pytest.raises(jinja2.TemplateError, match="no bad roles"):
        template.render(messages=[{"role": "bad"}], add_generation_prompt=False)
    # Escaping where a template asks for it, decided when it renders.
    escaping = compile_chat_template("{% autoescape true %}{{ x }}{% endautoescape %}"
                                     "{% autoescape 1 == 2 %}{{ x }}{% endautoescape %}{{ x }}")
    assert escaping.render(x="<&>") == "&lt;&amp;&gt;<&><&>"


def test_what_does_not_compile_raises_what_jinja_raises():
    with pytest.raises(jinja2.TemplateSyntaxError):
        compile_chat_template("{% for %}")
    with pytest.raises(RecursionError):
        compile_chat_template("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    with pytest.raises(jinja2.exceptions.SecurityError):  # the sandbox: at render
        compile_chat_template("{{ x.append(1) }}").render(x=[])


def test_chat_template_flag_is_a_file_or_the_template_itself_as_vllm_takes_it(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert read_chat_template(str(path)) == "{{ messages }}"
    assert read_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for m")
    assert read_chat_template("line one\nline two") == "line one\nline two"  # a newline: a template
    with pytest.raises(ModelDirError, match="looks like a file's path .* no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ModelDirError, match="not a regular file"):
        read_chat_template(str(tmp_path))


def test_a_chat_template_file_at_the_size_limit_is_read_and_one_byte_more_is_refused(tmp_path):
    path = tmp_path / "big.jinja"
    path.write_bytes(b"x" * MAX_TEMPLATE_BYTES)
    assert len(read_chat_template(str(path))) == MAX_TEMPLATE_BYTES
    path.write_bytes(b"x" * (MAX_TEMPLATE_BYTES + 1))
    with pytest.raises(ModelDirError, match="more than the 16,777,216 bytes it may have"):
        read_chat_template(str(path))
    path.write_bytes(b"\xff{{ x }}")
    with pytest.raises(ModelDirError, match="not UTF-8"):
        read_chat_template(str(path))
