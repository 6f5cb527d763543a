"""Rewrites of a distributed cell's model wrap. FSDP2 in place of DistributedDataParallel: the cell's
``x = DistributedDataParallel(model, ...)`` becomes ``fully_shard`` on each block of the model and on the
model, so that each rank keeps 1/N of the weights, gradients and optimizer state and gathers a block's
weights only while the block runs. Activation checkpointing: the model the wrap takes goes through
``oommagic.checkpointed`` first (``checkpoint_source``). A trial relaunches the ranks with the rewritten
cell.

Pure ``ast`` on the cell's text. The FSDP2 rewrite is refused (None) where the sharded model would not run
the cell's code as it stands: the optimizer built before the wrap (it would hold the parameters FSDP2
replaces), or DDP's own ``no_sync``/``join`` in use. Reads of ``x.module`` (DDP's wrapped model) read ``x``
itself after the rewrite: FSDP2 shards the model in place.
"""

from __future__ import annotations

import ast

_WRAPPERS = frozenset({"DistributedDataParallel", "DDP"})
_DDP_ONLY = frozenset({"no_sync", "join", "join_hook", "register_comm_hook"})
_OPTIMIZERS = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "LBFGS"}
)


def shard_source(source: str) -> str | None:
    """``source`` with its first ``x = DistributedDataParallel(model, ...)`` (or ``DDP(...)``) replaced by
    FSDP2's ``fully_shard`` on every block and on the model, and ``x.module`` read as ``x``; None where the
    cell has no such line or the sharded model would not run its code (see the module docstring)."""
    found = _parsed_wrap(source)
    if found is None:
        return None
    tree, scope, assign, target = found
    model = assign.value.args[0]  # type: ignore[attr-defined]
    ends = (assign.end_lineno or assign.lineno, assign.end_col_offset or 0)
    after = [n for n in _walk_scope(scope) if _starts(n) >= ends]
    before = [n for n in _walk_scope(scope) if _starts(n) < _starts(assign)]
    if any(_is_optimizer(n) for n in before):
        return None
    reads = [n for n in after if isinstance(n, ast.Attribute) and _is_name(n.value, target)]
    if any(n.attr in _DDP_ONLY for n in reads):
        return None

    lines = source.splitlines(keepends=True)
    edits = [
        (n.lineno, n.col_offset, n.end_lineno, n.end_col_offset, target) for n in reads if n.attr == "module"
    ]
    indent = lines[assign.lineno - 1].encode()[: assign.col_offset].decode()
    if indent.strip():  # another statement before it on its line
        return None
    given = ast.get_source_segment(source, model) or target
    block = [
        *([f"{target} = {given}"] if given != target else []),
        f"fsdp_blocks = [b for m in {target}.modules() if isinstance(m, (torch.nn.ModuleList, "
        "torch.nn.Sequential)) for b in m]",
        "for fsdp_block in reversed(fsdp_blocks):  # the innermost first: a block's weights gathered "
        "while it runs",
        "    if next(fsdp_block.parameters(), None) is not None:",
        "        fully_shard(fsdp_block)",
        f"{target} = fully_shard({target})  # in place of DistributedDataParallel: 1/N of the state per rank",
    ]
    last = assign.end_lineno or assign.lineno
    edits.append((assign.lineno, 0, last, len(lines[last - 1].rstrip("\r\n").encode()), None))
    rewritten = _apply(lines, edits, ("\n" + indent).join(block), indent)
    # Imported once at the top of the cell: an import inside the rank function would make `torch` a name
    # of that function, unbound where the function used it before.
    imports = "from torch.distributed.fsdp import fully_shard\n"
    if not any(
        isinstance(n, ast.Import) and any(a.name == "torch" and a.asname is None for a in n.names)
        for n in tree.body
    ):
        imports = "import torch\n" + imports
    return imports + rewritten


def checkpoint_source(source: str) -> str | None:
    """``source`` with the model its first ``x = DistributedDataParallel(model, ...)`` wraps handed through
    ``oommagic.checkpointed``: each block's activations recomputed in the backward pass on every rank, the
    batch, steps and update as written. None where the cell wraps no model so."""
    found = _parsed_wrap(source)
    if found is None:
        return None
    tree, _, assign, _ = found
    model = assign.value.args[0]  # type: ignore[attr-defined]
    given = ast.get_source_segment(source, model)
    if given is None or "\n" in given:
        return None
    lines = source.splitlines(keepends=True)
    line = lines[model.lineno - 1].encode()
    start, end = model.col_offset, model.end_col_offset or model.col_offset
    lines[model.lineno - 1] = (
        line[:start] + f"oommagic.checkpointed({given})".encode() + line[end:]
    ).decode()
    imported = any(
        isinstance(n, ast.Import) and any(a.name == "oommagic" and a.asname is None for a in n.names)
        for n in tree.body
    )
    return ("" if imported else "import oommagic\n") + "".join(lines)


def _apply(lines: list[str], edits: list[tuple], block: str, indent: str) -> str:
    """``lines`` with each edit (first line, first byte, last line, end byte, text) made, the last first;
    the edit whose text is None is the wrap's statement, its lines replaced by ``block`` at ``indent``."""
    data = [line.encode() for line in lines]
    for first, start, last, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        new = (indent + block).encode() if text is None else text.encode()
        head = data[first - 1][:start]
        data[first - 1 : last] = [head + new + data[last - 1][end:]]
    return b"".join(data).decode()


def _parsed_wrap(source: str) -> tuple[ast.Module, ast.AST, ast.Assign, str] | None:
    """The cell parsed, and its first DDP wrap (``_wrap``); None where it does not parse or has none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found = _wrap(tree)
    return None if found is None else (tree, *found)


def _wrap(tree: ast.Module) -> tuple[ast.AST, ast.Assign, str] | None:
    """The first ``name = DistributedDataParallel(model, ...)`` statement, its scope (the function that
    holds it, else the cell) and the name."""
    scopes: list[ast.AST] = [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))),
    ]
    for scope in scopes:
        for node in _walk_scope(scope):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Call)
                and _called(node.value) in _WRAPPERS
                and node.value.args
                and not isinstance(node.value.args[0], ast.Starred)
            ):
                return scope, node, node.targets[0].id
    return None


def _walk_scope(scope: ast.AST):
    """Every node of ``scope``'s own body, not those of the functions and classes it defines."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def _called(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _is_optimizer(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    chain = []
    while isinstance(func, ast.Attribute):
        chain.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        chain.append(func.id)
    return bool(chain) and (chain[0] in _OPTIMIZERS or "optim" in chain[1:])


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _starts(node: ast.AST) -> tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
