"""Rewrites of how a cell generates: its prompts run in chunks (through ``generate`` or a notebook function
that decodes by hand), and ``generate``'s settings written where the call takes them from.

Pure (``ast`` only), on the one parse of ``source``; the helper a chunked call needs is defined at the top of
the cell under a name fresh against the cell and the namespace, so the diff shows it and "Apply to cell"
keeps it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable

from .rewrite import _apply, _checked, fresh_name
from .source import SourceText, call_matches, tree_of

IN_CHUNKS = '''\
def in_chunks(func, chunk, *args, **kwargs):
    """func() over `chunk` rows of its batch at a time, one slice after another, the results joined in
    order: the batch is its first tensor argument; it and every tensor argument with as many rows (also in
    a dict) are sliced. Tensors are joined along the rows (right-padded to one length where they differ
    in the last), tuples and dicts item by item, lists one after another; a result without a row per
    prompt (a number, a mean over them) is an error, never joined into something else."""
    from collections.abc import Mapping

    import torch

    def tensors(v):
        if isinstance(v, torch.Tensor):
            return [v] if v.dim() else []
        return [t for x in v.values() for t in tensors(x)] if isinstance(v, Mapping) else []

    n = next(t for v in (*args, *kwargs.values()) for t in tensors(v)).shape[0]

    def part(v, i):
        if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n:
            return v[i : i + chunk]
        return {k: part(x, i) for k, x in v.items()} if isinstance(v, Mapping) else v

    starts = range(0, n, chunk)
    outs = [func(*[part(a, i) for a in args], **{k: part(v, i) for k, v in kwargs.items()}) for i in starts]
    sizes = [min(chunk, n - i) for i in starts]
    config = getattr(getattr(func, "__self__", None), "generation_config", None)
    pad = kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
    pad = getattr(config, "eos_token_id", 0) if pad is None else pad
    pad = (pad[0] if isinstance(pad, (list, tuple)) else pad) or 0

    def rows(parts):
        # As many rows per prompt in every chunk (sequences returned per prompt), else not a batch's result.
        per = {len(p) / s for p, s in zip(parts, sizes)}
        if len(per) != 1 or not per.pop().is_integer():
            raise ValueError(f"{func.__name__}'s results do not have a row per prompt: run it all at once")

    def join(parts):
        first = parts[0]
        if isinstance(first, torch.Tensor) and not first.dim():
            raise ValueError(f"{func.__name__} returned a number, not a row per prompt: run it all at once")
        if isinstance(first, torch.Tensor):
            rows(parts)
            width = max(p.shape[-1] for p in parts)
            return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=pad)
                              if p.dim() >= 2 and p.shape[-1] < width else p for p in parts])
        if isinstance(first, tuple) and not isinstance(first, Mapping):
            joined = [join([p[j] for p in parts]) for j in range(len(first))]
            return type(first)(*joined) if hasattr(first, "_fields") else tuple(joined)
        if isinstance(first, Mapping):
            return type(first)(**{k: join([p[k] for p in parts]) for k in first.keys()})
        if isinstance(first, list):
            rows(parts)
            return [x for p in parts for x in p]
        return parts

    return join(outs)
'''


def _helper(name: str, func_param: str) -> str:
    """The helper defining ``name`` with its callable's parameter called ``func_param``."""
    text = IN_CHUNKS.replace("def in_chunks(", f"def {name}(", 1)
    return re.sub(r"\bfunc\b", func_param, text) if func_param != "func" else text


def _chunked(source: str, calls: list[ast.Call], helper: str, chunk: int) -> str:
    """``source`` with each of ``calls`` (``f(a, b)``) written ``helper(f, chunk, a, b)``."""
    src = SourceText(source)
    edits = []
    for call in calls:
        func = src.segment(call.func)
        start, _ = src.span(call.func)
        open_paren = src.offset(call.func.end_lineno, call.func.end_col_offset)
        rest = "" if not (call.args or call.keywords) else ", "
        edits.append((start, open_paren + 1, f"{helper}({func}, {chunk}{rest}"))
    return _apply(source, edits)


def split_generate_source(source: str, chunk: int, taken: Iterable[str] = frozenset()) -> str | None:
    """The cell with each ``X.generate(...)`` call run over slices of ``chunk`` prompts one after another
    (``generate_in_chunks(X.generate, chunk, ...)``, defined at the top of the cell under a name fresh
    against the cell and ``taken``). None where the cell makes no such call."""
    tree = tree_of(source)
    if tree is None:
        return None
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "generate"
    ]
    if not calls:
        return None
    helper = fresh_name("generate_in_chunks", source, taken=taken)
    body = _chunked(source, calls, helper, chunk)
    return _checked(_helper(helper, "generate") + "\n\n" + body)


def split_calls_source(source: str, func: str, chunk: int, taken: Iterable[str] = frozenset()) -> str | None:
    """The cell with each call of the notebook function ``func`` by its plain name (``decode(lm, prompts,
    64)``) run over ``chunk`` rows of its batch at a time, the results joined in order: ``in_chunks(decode,
    8, lm, prompts, 64)``, with ``in_chunks`` defined at the top of the cell under a name fresh against the
    cell and ``taken``. None where the cell makes no such call."""
    tree = tree_of(source)
    if tree is None:
        return None
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id == func
        and not any(isinstance(a, ast.Starred) for a in n.args)
    ]
    if not calls:
        return None
    helper = fresh_name("in_chunks", source, taken=taken)
    return _checked(_helper(helper, "func") + "\n\n" + _chunked(source, calls, helper, chunk))


def set_generation_setting(
    source: str, keyword: str, value: object, given: Iterable[str] = (), func: str = "generate"
) -> str | None:
    """The cell with ``keyword=value`` in force in every call to ``func`` (a ``generate`` method, a
    pipeline) and never passed twice: the call's own keyword replaced where it passes one; else, where the
    call splats dicts (``**gen_kwargs``) and ``keyword`` may be in them (it is among ``given``, the
    keywords the call received at run time, or those are not known), the key set in the dict the cell
    itself makes (``gen_kwargs = dict(...)`` / ``{...}``), or the spreads merged into one with the
    setting after them (``**{**gen_kwargs, "max_new_tokens": 64}``); else the keyword added. None where
    the cell makes no such call."""
    tree = tree_of(source)
    if tree is None:
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and call_matches(n.func, func)]
    if not calls:
        return None
    given = set(given)
    src = SourceText(source)
    edits: list[tuple[int, int, str]] = []
    for call in calls:
        spreads = [k for k in call.keywords if k.arg is None]
        existing = next((k for k in call.keywords if k.arg == keyword), None)
        if existing is not None:
            edits.append((*src.span(existing.value), repr(value)))
        elif not spreads or (given and keyword not in given):
            end = src.offset(call.end_lineno, call.end_col_offset) - 1
            sep = ", " if (call.args or call.keywords) else ""
            edits.append((end, end, f"{sep}{keyword}={value!r}"))
        elif len(spreads) == 1 and (made := _made_dict(tree, spreads[0].value)) is not None:
            edits.append(_dict_edit(src, made, keyword, value))
        else:
            # One spread after the call's own keywords: a key of any of them is overridden, none twice.
            merged = ", ".join(f"**{src.segment(k.value)}" for k in spreads)
            edits.extend((*_keyword_span(src, k), "") for k in spreads[1:])
            edits.append((*src.span(spreads[0]), f"**{{{merged}, {keyword!r}: {value!r}}}"))
    return _checked(_apply(source, edits))


def _made_dict(tree: ast.Module, spread: ast.expr) -> ast.expr | None:
    """The dict display or ``dict(...)`` call the cell binds the name ``spread`` to (its only binding),
    else None."""
    if not isinstance(spread, ast.Name):
        return None
    name = spread.id
    values = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
    ]
    if len(values) != 1:
        return None
    value = values[0]
    if isinstance(value, ast.Dict) and all(k is not None for k in value.keys):
        return value
    dict_call = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict"
    if dict_call and not value.args and all(k.arg is not None for k in value.keywords):
        return value
    return None


def _dict_edit(src: SourceText, made: ast.expr, keyword: str, value: object) -> tuple[int, int, str]:
    """The edit setting ``keyword`` to ``value`` in the dict ``made`` (a display or a ``dict(...)`` call)."""
    if isinstance(made, ast.Dict):
        for key, old in zip(made.keys, made.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == keyword:
                return (*src.span(old), repr(value))
        end = src.offset(made.end_lineno, made.end_col_offset) - 1
        return (end, end, f"{', ' if made.keys else ''}{keyword!r}: {value!r}")
    assert isinstance(made, ast.Call)
    for kw in made.keywords:
        if kw.arg == keyword:
            return (*src.span(kw.value), repr(value))
    end = src.offset(made.end_lineno, made.end_col_offset) - 1
    return (end, end, f"{', ' if made.keywords else ''}{keyword}={value!r}")


def _keyword_span(src: SourceText, kw: ast.keyword) -> tuple[int, int]:
    """The span of ``kw`` with the comma before it, so that removing it leaves the call whole."""
    start, end = src.span(kw)
    before = start
    while before > 0 and src.text[before - 1] in " \t\n":
        before -= 1
    return (before - 1, end) if before > 0 and src.text[before - 1] == "," else (start, end)


__all__ = ["IN_CHUNKS", "set_generation_setting", "split_calls_source", "split_generate_source"]
