"""One owner for the KV cache: only conveyor/scheduler (and conveyor/kv itself) changes KV state.

Read from the source (AST), so a new module that frees or allocates blocks behind the scheduler's
back fails here: it must ask the scheduler (Scheduler.import_prefilled, release_handover, ...). The
runner gets block tables in the step's decision (SchedulerOutput.block_tables), never the manager.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conveyor.kv import BlockPool, KVCacheManager

PACKAGE = Path(__file__).resolve().parent.parent / "conveyor"
OWNERS = ("scheduler", "kv")  # the packages that may change KV state

# The methods that change a KV manager's or a block pool's state; checked against the classes below,
# so that a rename cannot silently empty this list.
MANAGER_WRITES = {"allocate", "free", "fork", "cache_full_blocks", "take_copies", "take_window_copies", "truncate",
                  "drop_out_of_sight"}
POOL_WRITES = {"allocate", "free", "share", "take_cached", "cache"}
# What would change the manager's containers in place (block_tables, num_slotted_tokens, ...).
CONTAINER_WRITES = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault"}
KV_NAMES = {"kv", "pool"}  # how the code names a KV manager or its pool


def _chain(node: ast.expr) -> list[str]:
    """The names along an attribute chain: engine.scheduler.kv.pool -> [engine, scheduler, kv, pool]."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names[::-1]
        else:
            return names[::-1]


def kv_writes(source: str) -> list[str]:
    """Every place in `source` that imports the KV manager's module or changes KV state."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names = {alias.name for alias in node.names}
            if node.module == "conveyor.kv.manager" or (node.module == "conveyor.kv" and names & {
                    "KVCacheManager", "BlockPool"}):
                found.append(f"line {node.lineno}: imports {node.module} {sorted(names)}")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name == "conveyor.kv.manager"]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = _chain(node.func.value)
            if not KV_NAMES & set(receiver):
                continue
            last = receiver[-1] if receiver else ""
            method = node.func.attr
            if (last in KV_NAMES and method in MANAGER_WRITES | POOL_WRITES) or method in CONTAINER_WRITES:
                found.append(f"line {node.lineno}: calls {'.'.join(receiver)}.{method}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                chain = _chain(target) if isinstance(target, (ast.Attribute, ast.Subscript)) else []
                # Assigning to a local named kv is fine; assigning into one (kv.x = ..., kv.t[i] = ...) is not.
                if KV_NAMES & set(chain[:-1] if isinstance(target, ast.Attribute) else chain):
                    found.append(f"line {node.lineno}: assigns to {'.'.join(chain)}")
    return found


def outside_owners() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in OWNERS)


def test_the_write_lists_name_real_methods() -> None:
    assert MANAGER_WRITES <= set(dir(KVCacheManager)) and POOL_WRITES <= set(dir(BlockPool))


@pytest.mark.parametrize("snippet", [
    "from conveyor.kv.manager import blocks_for",
    "import conveyor.kv.manager",
    "from conveyor.kv import KVCacheManager",
    "engine.scheduler.kv.free(request_id)",
    "self.engine.kv.allocate(rid, 4, cached)",
    "kv.cache_full_blocks(key, 8)",
    "engine.kv.pool.share(3)",
    "kv.block_tables.pop(rid)",
    "engine.scheduler.kv.enable_prefix_caching = False",
    "kv.block_tables[rid] = [1, 2]",
])
def test_the_check_sees_a_kv_write(snippet: str) -> None:
    assert kv_writes(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "from conveyor.kv import blocks_for",
    "kv = engine.scheduler.kv",
    "used = engine.scheduler.kv.usage().usage",
    "table = kv.block_tables.get(rid, [])",
    "engine.scheduler.release_handover(rid)",
    "self._parked.pop(rid, None)",
])
def test_the_check_lets_reads_and_scheduler_calls_pass(snippet: str) -> None:
    assert not kv_writes(snippet), kv_writes(snippet)


def test_only_the_scheduler_and_the_kv_package_change_kv_state() -> None:
    offenders = {str(p.relative_to(PACKAGE)): kv_writes(p.read_text()) for p in outside_owners()}
    assert {path: found for path, found in offenders.items() if found} == {}


def _parameters(path: Path, qualname: str) -> list[ast.arg]:
    tree = ast.parse(path.read_text())
    owner, _, name = qualname.rpartition(".")
    scope: list[ast.stmt] = tree.body
    if owner:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == owner).body
    func = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    return func.args.posonlyargs + func.args.args + func.args.kwonlyargs


@pytest.mark.parametrize("path, qualname", [
    ("runner/model_runner.py", "ModelRunner.execute"),
    ("runner/inputs.py", "build_inputs"),
    ("engine/llm_engine.py", "Runner.execute"),
    ("sim/runner.py", "SimRunner.execute"),
])
def test_the_runner_entry_points_take_no_kv_manager(path: str, qualname: str) -> None:
    params = _parameters(PACKAGE / path, qualname)
    assert params, f"{qualname} not found"
    for arg in params:
        annotation = ast.unparse(arg.annotation) if arg.annotation is not None else ""
        assert arg.arg not in KV_NAMES and "KVCacheManager" not in annotation and "BlockPool" not in annotation, \
            f"{qualname} takes {arg.arg}: {annotation}"
