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
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Template


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
    return env.from_string(source)


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
