"""Front end: a program's source, parsed and checked against the SelIR grammar (a whitelist).

Anything the grammar does not name is a `SelIRError` with file:line:col, the source line and a caret.
"""

from __future__ import annotations

import ast
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any

from detent_audit.selection import lang
from detent_audit.selection.errors import SelIRError

_STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.If, ast.For, ast.Return, ast.Expr, ast.Pass,
               ast.Break, ast.Continue)
_EXPRESSIONS = (ast.Constant, ast.Name, ast.Attribute, ast.Subscript, ast.BinOp, ast.UnaryOp, ast.BoolOp,
                ast.Compare, ast.IfExp, ast.Call, ast.Tuple, ast.List, ast.ListComp, ast.GeneratorExp,
                ast.keyword, ast.comprehension, ast.Slice)
_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd,
              ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Load,
              ast.Store)
_WHY = {
    "While": "`while` loops are not SelIR: loop over a static collection (`for x in range(N)`)",
    "Try": "`try` is not SelIR: a selection program cannot catch errors",
    "With": "`with` is not SelIR",
    "Lambda": "`lambda` is not SelIR: define a helper function in the module",
    "FunctionDef": "nested functions are not SelIR: define helpers at module level",
    "ClassDef": "classes inside a program are not SelIR: define @record classes at module level",
    "Global": "`global` is not SelIR: programs are pure",
    "Nonlocal": "`nonlocal` is not SelIR: programs are pure",
    "Import": "imports inside a program are not SelIR",
    "ImportFrom": "imports inside a program are not SelIR",
    "Delete": "`del` is not SelIR",
    "Assert": "`assert` is not SelIR: use require(cond, msg)",
    "Yield": "generators are not SelIR",
    "YieldFrom": "generators are not SelIR",
    "Await": "`await` is not SelIR",
    "JoinedStr": "f-strings are not SelIR: messages are plain string literals",
    "Starred": "star arguments are not SelIR",
    "NamedExpr": "`:=` is not SelIR",
    "DictComp": "dict comprehensions are not SelIR",
    "SetComp": "set comprehensions are not SelIR",
    "Set": "set literals are not SelIR: use a tuple",
    "Dict": "dict literals are not SelIR: tables are deployment facts",
    "Raise": "`raise` is not SelIR: use require(cond, msg)",
    "Match": "`match` is not SelIR: use if/elif/else",
    "AsyncFunctionDef": "async functions are not SelIR",
    "BitAnd": "bitwise operators are not SelIR", "BitOr": "bitwise operators are not SelIR",
    "BitXor": "bitwise operators are not SelIR", "LShift": "shifts are not SelIR",
    "RShift": "shifts are not SelIR", "Invert": "bitwise operators are not SelIR",
    "MatMult": "`@` is not SelIR", "Is": "`is` is not SelIR: compare with ==",
    "IsNot": "`is not` is not SelIR: compare with !=", "In": "`in` is not SelIR",
    "NotIn": "`not in` is not SelIR",
}


@dataclass(frozen=True)
class Source:
    """A module's text, its AST and its namespace (for records, module constants and helpers)."""

    filename: str
    text: str
    tree: ast.Module
    namespace: dict[str, Any]

    @property
    def functions(self) -> dict[str, ast.FunctionDef]:
        return {n.name: n for n in self.tree.body if isinstance(n, ast.FunctionDef)}

    def error(self, node: ast.AST | None, message: str, remedy: str | None = None) -> SelIRError:
        line = getattr(node, "lineno", None)
        col = getattr(node, "col_offset", None)
        return SelIRError(message, filename=self.filename, source=self.text, line=line, col=col,
                          remedy=remedy)


def source_of_function(fn: Any) -> Source:
    """The Source of the module that defines `fn`."""
    module = inspect.getmodule(fn)
    if module is None or not getattr(module, "__file__", None):
        raise SelIRError(f"cannot find the source module of {fn!r}")
    text, filename = inspect.getsource(module), str(module.__file__)
    return Source(filename, text, ast.parse(text, filename), vars(module))


def source_from_text(text: str, filename: str = "<selir>", module_name: str = "_selir_program") -> Source:
    """Execute `text` as a fresh module (records must exist as classes) and return its Source."""
    tree = _parse(text, filename)
    module = types.ModuleType(module_name)
    module.__file__ = filename
    sys.modules[module_name] = module  # dataclasses resolve annotations through sys.modules
    try:
        exec(compile(tree, filename, "exec"), vars(module))  # noqa: S102 - the program's own source
    finally:
        sys.modules.pop(module_name, None)
    return Source(filename, text, tree, vars(module))


def _parse(text: str, filename: str) -> ast.Module:
    try:
        return ast.parse(text, filename)
    except SyntaxError as exc:
        raise SelIRError(f"syntax error: {exc.msg}", filename=filename, source=text, line=exc.lineno,
                         col=(exc.offset or 1) - 1) from None


def check_grammar(src: Source, fn: ast.FunctionDef) -> None:
    """Raise `SelIRError` at the first construct of `fn` outside the SelIR grammar."""
    args = fn.args
    if args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs or args.defaults:
        raise src.error(fn, f"function `{fn.name}`: only plain positional parameters are SelIR")
    if fn.decorator_list and not all(_is_program_tag(d) for d in fn.decorator_list):
        raise src.error(fn.decorator_list[0], "decorators other than @program(...) are not SelIR")
    for stmt in fn.body:
        _check(src, stmt, stmt)


def _is_program_tag(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "program"


def _check(src: Source, node: ast.AST, parent: ast.AST) -> None:
    allowed = _STATEMENTS + _EXPRESSIONS + _OPERATORS
    if not isinstance(node, allowed):
        kind = type(node).__name__
        where = node if hasattr(node, "lineno") else parent  # operators carry no location of their own
        raise src.error(where, _WHY.get(kind, f"`{kind}` is not SelIR"))
    if isinstance(node, ast.Assign):
        for target in node.targets:
            _check_target(src, target)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For)):
        _check_target(src, node.target)
        if isinstance(node, ast.For) and node.orelse:
            raise src.error(node.orelse[0], "`for ... else` is not SelIR")
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name):
            raise src.error(node, "method calls are not SelIR: call a builtin or a helper by name",
                            remedy="builtins: " + ", ".join(sorted(lang.BUILTINS)))
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        raise src.error(node, "assigning to an attribute is not SelIR: programs are pure")
    elif isinstance(node, ast.comprehension) and node.is_async:
        raise src.error(node.target, "async comprehensions are not SelIR")
    elif isinstance(node, ast.Constant) and isinstance(node.value, (bytes, complex)) or node is Ellipsis:
        raise src.error(node, "this literal is not SelIR")
    for child in ast.iter_child_nodes(node):
        _check(src, child, node if hasattr(node, "lineno") else parent)


def _check_target(src: Source, target: ast.AST) -> None:
    if isinstance(target, ast.Name):
        return
    if isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
        return
    if isinstance(target, ast.Subscript):
        raise src.error(target, "assigning to an element is not SelIR: collections are immutable")
    if isinstance(target, ast.Attribute):
        raise src.error(target, "assigning to an attribute is not SelIR: programs are pure")
    raise src.error(target, "only names and tuples of names can be assigned in SelIR")


def program_inputs(src: Source, fn: ast.FunctionDef) -> list[tuple[str, str, ast.arg]]:
    """(name, kind, node) of the runtime parameters (all but the first, the facts record)."""
    params = fn.args.args
    if not params:
        raise src.error(fn, f"program `{fn.name}` needs the facts record as its first parameter")
    out = []
    for param in params[1:]:
        kind = _marker(param.annotation)
        if kind is None:
            raise src.error(param, f"parameter `{param.arg}` must be annotated Runtime[...], "
                                   "Unpinnable[...] or Request[...]")
        out.append((param.arg, kind, param))
    return out


def _marker(annotation: ast.AST | None) -> str | None:
    if annotation is None:
        return None
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        if annotation.value.id in lang.INPUT_KINDS:
            return annotation.value.id
    return None
