"""The Pallas kernels live in the top-level `pallas_kernels/`, apart from the engine, and ship with jaxcb.

Every `pallas_call` is in `pallas_kernels/*.py`; jaxcb has none of its own (its pallas attention
form calls the kernel). `pallas_kernels` imports nothing from jaxcb, and each kernel file reads
top to bottom: docstring, reference, checks, kernel, jitted wrapper. Read from the sources.
"""

import ast
import fnmatch
import os
import subprocess
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sources(package: str) -> dict[str, ast.Module]:
    """Every .py file under REPO/package, parsed: {path relative to REPO: module}."""
    found = {}
    for root, _, files in os.walk(os.path.join(REPO, package)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    found[os.path.relpath(path, REPO)] = ast.parse(f.read(), path)
    return found


def calls_pallas_call(node: ast.AST) -> bool:
    """Whether the code under node calls `pallas_call` (as `pl.pallas_call(...)` or a bare name): not comments."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            fn = call.func
            if (isinstance(fn, ast.Attribute) and fn.attr == "pallas_call") or (
                    isinstance(fn, ast.Name) and fn.id == "pallas_call"):
                return True
    return False


def imported_modules(module: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def test_every_pallas_call_is_in_pallas_kernels_and_jaxcb_has_none():
    kernels = [path for path, module in sources("pallas_kernels").items() if calls_pallas_call(module)]
    assert kernels == ["pallas_kernels/ragged_paged_attention.py"]
    assert [path for path, module in sources("jaxcb").items() if calls_pallas_call(module)] == []


def test_pallas_kernels_import_nothing_from_jaxcb():
    for path, module in sources("pallas_kernels").items():
        engine = sorted(name for name in imported_modules(module) if name.split(".")[0] == "jaxcb")
        assert engine == [], f"{path} imports {engine}: a kernel takes arrays and sizes, not engine parts"
    # Nor through a module it imports: a fresh interpreter loads the kernels without jaxcb.
    probe = "import sys, pallas_kernels; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jaxcb'))"
    env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_kernel_file_reads_reference_checks_kernel_then_jitted_wrapper():
    for path, module in sources("pallas_kernels").items():
        if not calls_pallas_call(module):
            continue
        assert ast.get_docstring(module), f"{path} starts with no docstring"
        defs = [node for node in module.body if isinstance(node, ast.FunctionDef)]
        names = [node.name for node in defs]
        reference = next(i for i, name in enumerate(names) if name.endswith("_reference"))
        checks = next(i for i, name in enumerate(names) if name.startswith("check_"))
        kernel = next(i for i, name in enumerate(names) if name.startswith("_") and "kernel" in name)
        wrapper = defs[-1]
        assert reference < checks < kernel < len(defs) - 1, f"{path}: {names}"
        assert calls_pallas_call(wrapper), f"{path}: the last function, {wrapper.name}, is not the wrapper"
        assert any("jit" in ast.unparse(d) for d in wrapper.decorator_list), f"{path}: {wrapper.name} is not jitted"


def test_an_installed_jaxcb_ships_pallas_kernels():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in ("jaxcb", "jaxcb.kernels.attention", "pallas_kernels"):
        assert any(fnmatch.fnmatch(package, pattern) for pattern in include), (package, include)
    assert os.path.isfile(os.path.join(REPO, "pallas_kernels", "__init__.py"))  # a package, not a namespace


def test_the_old_kernel_module_path_still_names_the_kernel():
    from jaxcb.kernels.attention import pallas as form
    import pallas_kernels.query_tiles as query_tiles
    import pallas_kernels.ragged_paged_attention as kernel

    assert form.ragged_paged_attention is kernel.ragged_paged_attention
    for name in ("query_tiles", "step_tile_table", "choose_num_splits", "QueryTiles", "kernel_tile_sizes"):
        assert getattr(form, name) is getattr(query_tiles, name), name
