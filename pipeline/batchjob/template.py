"""A chat template compiled as transformers compiles it, with nothing of it run at load.

transformers renders chat templates in Jinja's immutable sandbox, with trim_blocks and
lstrip_blocks, loop controls, `raise_exception` and a `tojson` that does not escape HTML; so
does this. A template is foreign code: Jinja evaluates constant expressions while compiling
(`{{ 'A' * 3000000000 }}` allocates 3 GB at load), so here it evaluates none: the optimizer
is off (optimized=False), a finalize that needs the render's context keeps every output
expression for render time (Jinja folds output expressions whatever `optimized` says), and
the code generator does not evaluate `{% autoescape EXPR %}` values either. Whatever a
template then does, it does per render, where the caller makes its failure the request's.

    template = compile_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    template.render(messages=[...], add_generation_prompt=True)

`read_chat_template` reads `--chat-template` as vLLM's flag takes it: a file's path, or the
template's text itself.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from pipeline.wire.errors import ModelDirError

if TYPE_CHECKING:
    from jinja2 import Template

# Largest chat template read from a file (real ones are a few KiB, tool-calling ones ~20 KiB;
# tokenizer_config.json, which may hold one, is read up to 16 MiB): past it, not a template.
MAX_TEMPLATE_BYTES = 16 << 20
# What tells a template's text from a path, as vLLM tells them: a path holds none of these.
JINJA_CHARS = "{}\n"


def read_chat_template(value: str) -> str:
    """--chat-template's template: the file `value` names, else `value` itself where it
    holds Jinja's characters; ModelDirError for a path that cannot be read (vLLM's rule:
    text with none of `{`, `}` or a newline is a path)."""
    if os.path.exists(value) and not os.path.isfile(value):  # a FIFO would block the read
        raise ModelDirError(f"--chat-template {value}: not a regular file")
    if not os.path.exists(value):
        if any(char in value for char in JINJA_CHARS):
            return value
        raise ModelDirError(f"--chat-template {value}: looks like a file's path (no {{, }} or newline), and there is "
                            f"no such file")
    return read_text_file(value, MAX_TEMPLATE_BYTES, f"--chat-template {value}")


def read_text_file(path: str | os.PathLike, limit_bytes: int, what: str) -> str:
    """A small UTF-8 file's text (bounded: at most limit+1 bytes read), or ModelDirError
    naming `what` (the path, or the option that named it)."""
    try:
        with open(path, "rb") as file:
            data = file.read(limit_bytes + 1)
    except OSError as exc:
        raise ModelDirError(f"{what}: cannot be read ({exc.strerror})") from exc
    if len(data) > limit_bytes:
        raise ModelDirError(f"{what}: more than the {limit_bytes:,} bytes it may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelDirError(f"{what}: not UTF-8 text (byte {exc.start})") from exc


def compile_chat_template(source: str) -> Template:
    """The compiled template; what Jinja raises where it does not compile (TemplateSyntaxError,
    and for pathological text RecursionError or MemoryError from the parser)."""
    import jinja2

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, >, & and ' for HTML: a prompt wants the JSON as it is.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # NOTE: transformers also defines strftime_now (today's date). Left out on purpose: a
    # prompt must be a function of its request alone, or a job resumed tomorrow makes other
    # tokens and shapes for the same requests; templates that use it test `is defined`.
    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                               optimized=False)
    env.finalize = jinja2.pass_context(lambda _context, value: value)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(source)
    # A plain dict of the same names: a render copies the globals into its context, and
    # Jinja's ChainMap over the environment's made that copy most of a short render's cost
    # (8% of a producer's time on a 200,000-request job, py-spy). Nothing changes them later.
    template.globals = dict(template.globals)
    return template


def _environment_class() -> type:
    """ImmutableSandboxedEnvironment whose code generator evaluates no `{% autoescape EXPR %}`
    value at load (the one place left where Jinja evaluates expressions while compiling)."""
    from jinja2.compiler import CodeGenerator, Frame
    from jinja2.nodes import EvalContextModifier
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_EvalContextModifier(self, node: EvalContextModifier, frame: Frame) -> None:
            # Jinja's own also evaluates each value here, to know it at load when it is constant.
            for keyword in node.options:
                self.writeline(f"context.eval_ctx.{keyword.key} = ")
                self.visit(keyword.value, frame)
            frame.eval_ctx.volatile = True

    return type("ChatTemplateEnvironment", (ImmutableSandboxedEnvironment,), {"code_generator_class": Generator})
